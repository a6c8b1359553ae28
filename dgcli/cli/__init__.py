"""The `dgemma` command line: thin Typer commands that resolve settings, load, call the library and
hand results to a renderer.

Owns: the Typer app, command registration, `--version`, and `main()`'s error contract: known errors are one
line on stderr and exit 2 (a traceback only with DGEMMA_DEBUG=1), bare `dgemma` prints the help, Ctrl-C exits
130, a closed stdout pipe 141 without a word. Must not: import torch at module level, directly or through the
command modules (`dgemma --help` and `dgemma CMD --help` stay instant).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Optional

import typer
from typer.core import TyperCommand

from dgcli import __version__
from dgcli.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Run, watch, sweep and benchmark DiffusionGemma block text-diffusion checkpoints.")


class _Command(TyperCommand):
    """Arguments show their metavar alone: Typer appends the Python type (`PROMPT <str>`), which says
    nothing to a shell user."""

    def format_options(self, ctx, formatter) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            rv = param.get_help_record(ctx)
            if rv is None:
                continue
            if param.param_type_name == "argument":
                args.append((param.metavar or rv[0], rv[1]))
            else:
                opts.append(rv)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _register(name: str, module) -> None:
    """One command: its summary is the docstring's first line (given whole, so the top-level help never
    cuts it with '...'), its epilog the module's EXAMPLES."""
    fn = getattr(module, name)
    summary = fn.__doc__.strip().splitlines()[0]
    epilog = "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in module.EXAMPLES)
    app.command(name, cls=_Command, short_help=summary, epilog=epilog)(fn)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dgemma {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                                  help="Print the version and exit.", show_default=False)) -> None:
    pass


# Commands: each module imports only typer and torch-free dgcli modules (options, errors, text.prompts)
# at module level; torch and the library load inside command bodies, so help and usage errors stay instant.
from dgcli.cli import bench as cmd_bench
from dgcli.cli import generate as cmd_generate
from dgcli.cli import info as cmd_info
from dgcli.cli import quantize as cmd_quantize
from dgcli.cli import serve as cmd_serve
from dgcli.cli import sweep as cmd_sweep
from dgcli.cli import watch as cmd_watch

for _name, _module in (("generate", cmd_generate), ("watch", cmd_watch), ("sweep", cmd_sweep),
                      ("bench", cmd_bench), ("info", cmd_info), ("serve", cmd_serve), ("quantize", cmd_quantize)):
    _register(_name, _module)


def _closed_pipe() -> None:
    """stdout's reader went away (`| head -1`): exit 141 (128 + SIGPIPE) quietly, as a shell reports cat killed by
    the signal; stdout now points at devnull so the flush at exit cannot fail again (Python's signal docs)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (captured by a test runner): nothing to redirect
        pass
    sys.exit(141)


_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


# Every DGEMMA_* variable dgemma reads; any other is a typo or a retired switch, and would change nothing silently.
KNOWN_VARIABLES = ("DGEMMA_KERNELS", "DGEMMA_FP8", "DGEMMA_API_KEY", "DGEMMA_DEBUG")


def _check_variables() -> None:
    """A DGEMMA_* variable dgemma does not know: one warning line; a kernel switch with a bad value: one error line
    and exit 2, before anything loads (the kernels would raise it at their first call); OMP_NUM_THREADS beyond the
    thread bound: capped, with a warning."""
    from dgcli.kernels import switches

    try:
        switches.mode(), switches.fp8_semantics()
    except ValueError as e:
        print(f"dgemma: error: {e}", file=sys.stderr)
        sys.exit(2)
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit():
        from dgcli.runtime.preflight import THREADS_PER_CORE, thread_limit

        if int(threads) > thread_limit():  # capped, not refused: a shell's or scheduler's setting, not this command's
            print(f"dgemma: warning: OMP_NUM_THREADS={threads} is more than {thread_limit()} ({THREADS_PER_CORE} per "
                  f"core here), which only slows a run and can crash torch's thread pool; using {thread_limit()}",
                  file=sys.stderr)
            os.environ["OMP_NUM_THREADS"] = str(thread_limit())
    for name in sorted(os.environ):
        if name.startswith("DGEMMA_") and name not in KNOWN_VARIABLES:
            print(f"dgemma: warning: {name} is not a dgemma setting and changes nothing (known: "
                  f"{', '.join(KNOWN_VARIABLES)})", file=sys.stderr)


def main() -> None:
    from dgcli.kernels.native import NativeBuildError

    _check_variables()
    try:
        rc = app(standalone_mode=False)
        sys.stdout.flush()  # a write that is still buffered must fail here, not at interpreter exit
        if rc == 130:  # click turns Ctrl-C into this return value when not standalone
            print("dgemma: interrupted", file=sys.stderr)
            sys.exit(130)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except (UserError, NativeBuildError) as e:
        if os.environ.get("DGEMMA_DEBUG") == "1":
            raise
        print(f"dgemma: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("dgemma: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        _closed_pipe()
    except OSError as e:  # a full disk or a failing device under the output: one line, as bad input gets
        if e.errno not in _WRITE_ERRORS or os.environ.get("DGEMMA_DEBUG") == "1":
            raise
        where = f" {e.filename}" if e.filename else " the output"
        print(f"dgemma: error: cannot write{where}: {e.strerror} (free space, or write elsewhere)", file=sys.stderr)
        sys.exit(2)
    except SystemExit as e:
        if isinstance(e.__context__, BrokenPipeError):  # click turns EPIPE into SystemExit(1) while handling it
            _closed_pipe()
        raise
    except Exception as e:  # click's exceptions: from click itself or from the copy newer typer vendors
        name = type(e).__name__
        if name == "Exit":
            sys.exit(getattr(e, "exit_code", 0))
        if name == "Abort":
            print("dgemma: aborted", file=sys.stderr)
            sys.exit(130)
        if name == "NoArgsIsHelpError":  # bare `dgemma` asks what there is: the help, as -h prints it
            print(e.format_message())
            sys.exit(0)
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # usage errors: one line, like ours
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            if ctx is not None and "unexpected extra argument" in e.format_message() and any(
                    "PROMPT" in p for p in ctx.command.collect_usage_pieces(ctx)):  # `dgemma generate Sort: 3 1`
                hint = f" (a prompt with spaces is one argument: quote it, dgemma {ctx.info_name} \"...\")"
            print(f"dgemma: error: {e.format_message()}{hint}", file=sys.stderr)
            sys.exit(e.exit_code)
        raise
