"""User-facing errors: one line that names the problem and the fix. The CLI prints them without a traceback."""


class UserError(Exception):
    """A problem the user can fix (bad input, missing file, impossible setting)."""
