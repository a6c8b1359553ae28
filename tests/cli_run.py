"""`dgemma ARGV` in-process through the real entry point, for CLI tests: (exit code, stdout, stderr)."""

import sys

from dgcli import cli


def run(argv, capsys, stdin=None, monkeypatch=None):
    """Run `dgemma *argv` in this process (stdin text if given, through `monkeypatch`)."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", _Stdin(stdin))
    old = sys.argv
    sys.argv = ["dgemma", *argv]
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return code, out.out, out.err


class _Stdin:
    def __init__(self, text):
        self.text = text

    def read(self):
        return self.text

    def isatty(self):
        return False
