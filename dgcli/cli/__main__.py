"""`python -m dgcli.cli ...`: the `dgemma` console script run as a module (e.g. under `python -X importtime`).

Owns: only the call into `dgcli.cli.main`. Must not: import anything else or hold behaviour of its own.
"""

from dgcli.cli import main

if __name__ == "__main__":
    main()
