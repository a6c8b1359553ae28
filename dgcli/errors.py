"""User-facing errors: one line that names the problem and the fix. The CLI prints them without a traceback.

Owns: `UserError`. Must not: import anything (every layer raises it).
"""


class UserError(Exception):
    """A problem the user can fix (bad input, missing file, impossible setting)."""
