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


def forbid(monkeypatch, targets, why: str) -> None:
    """Make each (module, name) in `targets` fail the test with `why` when called (e.g. loading weights before
    a flag is checked)."""
    def boom(*a, **k):
        raise AssertionError(why)

    for mod, name in targets:
        monkeypatch.setattr(mod, name, boom)


class _Stdin:
    def __init__(self, text):
        self.text = text

    def read(self):
        return self.text

    def isatty(self):
        return False
