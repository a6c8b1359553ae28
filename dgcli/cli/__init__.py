"""The `dgemma` command line: thin Typer commands that resolve settings, load, call the library and
hand results to a renderer.

Owns: the Typer app, command registration, `--version`, and `main()`'s error contract: known errors
become one line on stderr and exit code 2 (a traceback only with DGEMMA_DEBUG=1), Ctrl-C exits 130.
Must not: import torch (or anything a command body imports) at module level, directly or through the
command modules: `dgemma --help`, `--version` and `dgemma CMD --help` load only typer and dgcli.cli
(tests/cli/test_startup.py checks it).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from dgcli import __version__
from dgcli.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Run, watch, sweep and benchmark DiffusionGemma block text-diffusion checkpoints.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dgemma {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                                  help="Print the version and exit.")) -> None:
    pass


# Commands: each module imports only typer and torch-free dgcli modules (options, errors, text.prompts)
# at module level; torch and the library load inside command bodies, so help and usage errors stay instant.
from dgcli.cli import bench as cmd_bench
from dgcli.cli import generate as cmd_generate
from dgcli.cli import info as cmd_info
from dgcli.cli import sweep as cmd_sweep
from dgcli.cli import watch as cmd_watch

app.command("generate")(cmd_generate.generate)
app.command("watch")(cmd_watch.watch)
app.command("sweep")(cmd_sweep.sweep)
app.command("bench")(cmd_bench.bench)
app.command("info")(cmd_info.info)


def main() -> None:
    try:
        rc = app(standalone_mode=False)
        if rc == 130:  # click turns Ctrl-C into this return value when not standalone
            print("dgemma: interrupted", file=sys.stderr)
            sys.exit(130)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except UserError as e:
        if os.environ.get("DGEMMA_DEBUG") == "1":
            raise
        print(f"dgemma: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("dgemma: interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as e:  # click's exceptions: from click itself or from the copy newer typer vendors
        name = type(e).__name__
        if name == "Exit":
            sys.exit(getattr(e, "exit_code", 0))
        if name == "Abort":
            print("dgemma: aborted", file=sys.stderr)
            sys.exit(130)
        if name == "NoArgsIsHelpError":  # bare `dgemma`: the help text
            e.show()
            sys.exit(e.exit_code)
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # usage errors: one line, like ours
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print(f"dgemma: error: {e.format_message()}{hint}", file=sys.stderr)
            sys.exit(e.exit_code)
        raise
