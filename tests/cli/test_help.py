"""Help pages (issue 14, item 9): `-h` everywhere, an example block per command whose examples parse,
one way of writing defaults, metavars instead of Python types, and top-level summaries that are not cut."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from dgcli.cli import app

COMMANDS = ["generate", "watch", "sweep", "bench", "info"]
PYTHON_TYPE = re.compile(r"<(str|int|float|bool|list\[\w+\]|path)>")


def help_text(*args: str, width: int = 80) -> str:
    r = CliRunner().invoke(app, [*args, "-h"], terminal_width=width)
    assert r.exit_code == 0, (r.output, r.exception)
    return r.output


def examples(text: str) -> list[str]:
    assert "Examples:" in text, text
    return [line.strip() for line in text.split("Examples:", 1)[1].splitlines() if line.strip()]


@pytest.mark.parametrize("args", [[], *[[c] for c in COMMANDS]], ids=lambda a: " ".join(a) or "dgemma")
def test_dash_h_is_help(args):
    text = help_text(*args)
    assert text.startswith("Usage: ") and "-h, --help" in text


@pytest.mark.parametrize("cmd", COMMANDS)
def test_each_command_has_examples_that_parse(cmd):
    lines = examples(help_text(cmd))
    assert 2 <= len(lines) <= 4, lines
    for line in lines:
        argv = shlex.split(line.split("|")[-1].split("#")[0])  # `echo x | dgemma ...`, trailing comments
        assert argv[:2] == ["dgemma", cmd], line
        # Every flag of the example exists: click rejects an unknown option before acting on -h.
        r = CliRunner().invoke(app, [*argv[1:], "-h"])
        assert r.exit_code == 0, (line, r.output)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_metavars_not_python_types(cmd):
    text = help_text(cmd)
    assert not PYTHON_TYPE.search(text), PYTHON_TYPE.search(text).group(0)


@pytest.mark.parametrize("args", [[], *[[c] for c in COMMANDS]], ids=lambda a: " ".join(a) or "dgemma")
def test_defaults_written_one_way(args):
    text = " ".join(help_text(*args, width=1000).split())  # unwrapped: a default is never split over lines
    assert "(default" not in text and "default:" not in text.replace("[default:", ""), text


def test_sampler_defaults_stay_visible():
    text = " ".join(help_text("generate", width=1000).split())
    for flag, default in (("--diffusion-steps", "48"), ("--t-min", "0.4"), ("--t-max", "0.8"),
                          ("--entropy-bound", "0.1"), ("--confidence-threshold", "0.005")):
        assert re.search(re.escape(flag) + r"[^\[]*\[default: " + re.escape(default) + r", or the checkpoint's\]", text), flag
    # The block count follows the token budget (issue 14): the help says so, and names --max-tokens.
    assert re.search(r"--blocks[^\[]*\[default: ceil\(token budget / canvas\): the checkpoint's max_new_tokens or "
                     r"--max-tokens; 1 without a budget\]", text)
    assert re.search(r"--threads[^\[]*\[default: OMP_NUM_THREADS if set, else 1 for a CPU model under 50 M", text)


@pytest.mark.parametrize("width", [80, 60])
def test_top_level_summaries_are_not_cut(width):
    text = help_text(width=width)
    listed = text.split("Commands:", 1)[1]
    assert "..." not in listed and "…" not in listed, listed
    for cmd in COMMANDS:
        doc = getattr(app.registered_commands[COMMANDS.index(cmd)].callback, "__doc__")
        summary = doc.strip().splitlines()[0]
        assert len(summary) <= 60, summary
        assert "".join(summary.split()) in "".join(listed.split()), (cmd, listed)  # wrapped, never cut
