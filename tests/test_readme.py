"""The README's examples run: every example line of README.md, in order, in one temporary directory, on the
bundled model, exits 0.

What runs: the lines of its ```sh blocks and its ```python blocks (plain ``` blocks are install steps and are
not run here). A line ending in `# needs: gpu` or `# needs: real model` is skipped; the README says so to its
readers. `dgemma serve` lines start the server in the background on a free port (each later line's
`127.0.0.1:8000` is pointed there) and it stops after the last line; every file the examples write is one
`.gitignore` names (a user runs them in a checkout). Besides that slow run, fast checks keep the README a user's
page: short, every command shown, no development log.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS = re.compile(r"#\s*needs:\s*(.+?)\s*$")
REASONS = {"gpu", "real model"}
COMMANDS = ["generate", "watch", "bench", "sweep", "info", "serve", "quantize"]
PORT = "127.0.0.1:8000"


def examples(text: str) -> list[tuple[str, str]]:
    """(language, code) in README order: one entry per line of a ```sh block, one per ```python block."""
    out, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip() or "plain", []
                continue
            if lang == "python":
                out.append(("python", "\n".join(body)))
            lang = None
        elif lang == "sh" and line.strip() and not line.lstrip().startswith("#"):
            out.append(("sh", line))
        elif lang is not None:
            body.append(line)
    assert lang is None, "README.md has an unclosed ``` block"
    return out


def needs(code: str) -> str | None:
    """The reason a line is not run here (`# needs: ...` at its end), or None."""
    m = NEEDS.search(code.splitlines()[-1] if code else "")
    return m.group(1) if m else None


def test_readme_is_short_and_has_no_development_log():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    assert not re.search(r"\bissues?\s+\d+", text, re.I), "issue numbers belong in benchmarks/RESULTS.md"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated notes belong in benchmarks/RESULTS.md"
    for marker in ("<!-- run-command -->", "<!-- /run-command -->", "<!-- test-command -->", "<!-- /test-command -->"):
        assert text.count(marker) == 1, marker  # .ci/run extracts the test command between these


def test_the_test_command_runs_pytest_by_the_venvs_entry_point():
    """`python -m pytest` would put the checkout's root first on sys.path, and its kernels/ would hide the PyPI
    `kernels` that transformers imports (tests/test_layout.py checks the running process too)."""
    text = README.read_text()
    cmd = text.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    assert "-m pytest" not in cmd and " .venv/bin/pytest " in cmd, cmd
    assert re.search(r"-e '\.\[test\]'", cmd), cmd  # the test extras (pinned in pyproject.toml) installed


def test_every_command_has_an_example_and_every_skip_says_why():
    found = examples(README.read_text())
    for lang, code in found:
        reason = needs(code)
        assert reason is None or reason in REASONS, f"unknown `# needs:` reason {reason!r} in: {code}"
    runnable = [c for lang, c in found if lang == "sh" and needs(c) is None]
    for cmd in COMMANDS[:-1]:  # quantize needs a real bf16 checkpoint
        assert any(re.search(rf"\bdgemma {cmd}\b", c) for c in runnable), f"no runnable `dgemma {cmd}` example"
    assert any("dgemma quantize" in c for _, c in found)
    assert any(lang == "python" for lang, _ in found)


def test_examples_parser_on_a_sample():
    sample = "```\npip install x\n```\n```sh\ndgemma info\n# a comment\n\ndgemma x  # needs: gpu\n```\n" \
             "```python\nimport dgcli\nprint(1)\n```\n"
    got = examples(sample)
    assert got == [("sh", "dgemma info"), ("sh", "dgemma x  # needs: gpu"), ("python", "import dgcli\nprint(1)")]
    assert [needs(c) for _, c in got] == [None, "gpu", None]


def _run(argv: list[str], cwd: Path, what: str, timeout: float = 300) -> None:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"README example failed (exit {r.returncode}):\n{what}\n--- stdout\n" \
                              f"{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-3000:]}"


@pytest.mark.slow
def test_readme_examples_run_in_order(tmp_path):
    from server_proc import serve

    ran = []
    # The examples run as from a checkout's root (paths such as dgcli/data/tiny), their files landing here.
    (tmp_path / "dgcli").symlink_to(README.parent / "dgcli", target_is_directory=True)
    with ExitStack() as stack:
        port = PORT
        for lang, code in examples(README.read_text()):
            if needs(code):
                continue
            code = code.replace(PORT, port)
            if lang == "python":
                _run([sys.executable, "-c", code], tmp_path, code)
            elif code.startswith("dgemma serve"):
                args = shlex.split(code, comments=True)[2:]
                server = stack.enter_context(serve(*args, tmp_path=tmp_path))
                port = f"127.0.0.1:{server.port}"
            else:
                if code.startswith("ray start"):  # a failing later line must not leave the head running
                    stack.callback(subprocess.run, ["ray", "stop"], cwd=tmp_path, capture_output=True, timeout=60)
                _run(["bash", "-eo", "pipefail", "-c", code], tmp_path, code)
            ran.append(code)
    assert len(ran) >= 15, ran  # the README's examples, not a parse that found nothing
    # Run in a checkout's root, they would leave these there: git must ignore every one.
    written = sorted(p.name for p in tmp_path.iterdir() if p.name != "dgcli" and not p.name.startswith("serve-"))
    assert written, "the examples wrote no file: this check would pass on anything"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=README.parent, capture_output=True,
                             text=True).stdout.split()
    assert sorted(ignored) == written, f"README examples leave files git does not ignore: {set(written) - set(ignored)}"
