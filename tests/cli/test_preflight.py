"""The CLI's bad-input path: what used to crash (a huge thread count, a huge slot count, an output place that cannot
take files) is one line; every check that needs no weights answers before they load (a checkpoint whose
model.safetensors is garbage still gives the argument's error) and, where it needs no model at all, before torch is
imported; and the smaller things a new user hit (NaN weights, a GGUF's fallback types, a missing .gguf, /dev/null as a
preset, an empty --api-key, NUL bytes on stdin, a finished sweep resumed, an empty /v1/completions answer, watch's
first line). All on the bundled model, copies of it, or files made from it."""

from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_run import run
from dgcli.runtime.session import BUNDLED

DGEMMA = str(Path(sys.executable).with_name("dgemma"))
TORCH_IMPORT = re.compile(r"\|\s+torch\s*$", re.M)  # python -X importtime's line for `import torch`


def one_error(code: int, out: str, err: str, *needles: str) -> str:
    """The bad-input contract: exit 2, nothing on stdout, one `dgemma: error:` line holding every needle."""
    assert code == 2 and out == "", (code, out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dgemma: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def dgemma(*argv: str, stdin: str | None = None, env: dict | None = None, timeout: float = 120):
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPROFILEIMPORTTIME", "OMP_NUM_THREADS")}
    return subprocess.run([DGEMMA, *argv], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})})


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory) -> Path:
    """The bundled checkpoint with its weights replaced by garbage: any load of them fails (with another line)."""
    d = tmp_path_factory.mktemp("corrupt") / "tiny"
    shutil.copytree(BUNDLED, d)
    (d / "model.safetensors").write_bytes(b"not a safetensors file\n")
    return d


# --- item 1: crashes ---------------------------------------------------------------------------------------

@pytest.mark.slow  # two runs in fresh interpreters (~6 s)
def test_a_huge_thread_count_is_refused_and_a_huge_omp_num_threads_capped():
    r = dgemma("generate", "--threads", "100000", "Reverse: c a t")  # was: rc -11 (SIGSEGV), no word
    line = one_error(r.returncode, r.stdout, r.stderr, "--threads 100000", "at most")
    limit = int(re.search(r"at most (\d+)", line).group(1))
    assert 1 <= limit < 100000
    r = dgemma("generate", "Reverse: c a t", env={"OMP_NUM_THREADS": "100000"})  # a shell's setting: capped, said
    assert r.returncode == 0 and r.stdout == "t a c\n", r.stderr
    assert f"OMP_NUM_THREADS=100000 is more than {limit}" in r.stderr and f"using {limit}" in r.stderr


def test_slots_that_cannot_fit_are_refused_before_the_weights_load(corrupt, capsys):
    """serve --max-batch-size 100000 allocated until the OOM killer came; bench's slots the same. The memory model
    refuses them from the config, so the garbage weights are never read, and names the largest that fits."""
    line = one_error(*run(["serve", "-m", str(corrupt), "--max-batch-size", "100000000"], capsys),
                     "--max-batch-size 100000000:", "GiB")
    most = int(re.search(r"at most ([\d,]+) fit with every slot busy: --max-batch-size (\d+)", line).group(2))
    assert 0 < most < 100000000
    one_error(*run(["bench", "-m", str(corrupt), "--random-prompts", "--num-prompts", "100000000", "--batch-size",
                    "1,100000000", "--no-measure-peaks"], capsys), "--batch-size 100000000:", "at most")


def test_output_places_that_cannot_take_files_are_one_line_before_any_work(capsys, tmp_path):
    """root passes every permission check: /proc still refuses a new file. quantize printed a traceback."""
    one_error(*run(["quantize", str(BUNDLED), "/proc/x.gguf", "--type", "q8_0"], capsys), "DST /proc/x.gguf")
    one_error(*run(["quantize", str(BUNDLED), "/proc/x/fp8", "--fp8"], capsys), "DST /proc/x/fp8")
    one_error(*run(["generate", "--trace", "/proc/t.jsonl", "Reverse: c a t"], capsys), "--trace /proc/t.jsonl")
    one_error(*run(["watch", "--trace", "/proc/t.jsonl", "Reverse: c a t"], capsys), "--trace /proc/t.jsonl")
    one_error(*run(["sweep", "-o", "/proc/rows.jsonl", "--dry-run"], capsys), "--output /proc/rows.jsonl")
    one_error(*run(["bench", "--result-dir", "/proc", "--runs", "1", "--no-measure-peaks"], capsys), "/proc")
    assert not list(tmp_path.iterdir())


# --- item 2: checks before the load --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["generate", "--batch-size", "-1", "hi"], "--batch-size -1"),
    (["generate", "--dtype", "int8", "hi"], "dtype='int8'"),
    (["generate", "--blocks", "1000", "hi"], "1000 block(s) of 16 exceed the model's context"),
    (["sweep", "--diffusion-steps", "8,abc", "--dry-run"], "'abc'"),
    (["bench", "--dtype", "int8"], "dtype='int8'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_argument_errors_come_before_torch_and_the_weights(corrupt, argv, needle):
    r = dgemma(argv[0], "-m", str(corrupt), *argv[1:], env={"PYTHONPROFILEIMPORTTIME": "1"})
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("import time:"))
    one_error(r.returncode, r.stdout, err, needle)
    assert "import time:" in r.stderr and not TORCH_IMPORT.search(r.stderr), "torch was imported before the check"


@pytest.fixture(scope="module")
def no_template(tmp_path_factory, corrupt) -> dict:
    """A GGUF file without a chat template whose tensors cannot load (one of an unsupported type, Q4_1), and a
    checkpoint directory without one whose weights are garbage."""
    import gguf as G

    from dgcli.checkpoint.gguf import GGUFFile, TensorOut, write_gguf
    from dgcli.checkpoint.quantize import checkpoint_to_gguf

    d = tmp_path_factory.mktemp("notemplate")
    checkpoint_to_gguf(BUNDLED, d / "good.gguf", "f32")
    src = GGUFFile(d / "good.gguf")
    tensors = []
    for name, info in src.tensors.items():
        if name == "blk.1.attn_q.weight":
            q = G.quants.quantize(src.array(name), G.GGMLQuantizationType.Q4_1)
            tensors.append(TensorOut(name, info.shape, 3, lambda q=q: q))
        else:
            tensors.append(TensorOut(name, info.shape, info.type, lambda name=name: src.array(name)))
    md = {k: v for k, v in src.metadata.items() if k != "tokenizer.chat_template"}
    write_gguf(d / "bad.gguf", md, tensors)
    folder = d / "dir"
    shutil.copytree(corrupt, folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").unlink()
    return {"gguf": d / "bad.gguf", "dir": folder}


def test_a_checkpoint_without_a_chat_template_is_refused_before_its_weights(no_template, capsys):
    for kind in ("gguf", "dir"):  # (the weights' own error came first: Q4_1, or garbage)
        one_error(*run(["generate", "-m", str(no_template[kind]), "Reverse: c a t"], capsys), "has no chat template",
                  "--raw")
    # --raw needs no template: the weights load, and their error is the one
    one_error(*run(["generate", "--raw", "-m", str(no_template["gguf"]), "Reverse: c a t"], capsys), "Q4_1")


def test_a_prompt_too_long_for_the_context_is_refused_from_its_length(corrupt, capsys, monkeypatch):
    """10 M characters cannot be 4,032 tokens (no token covers more than the tokenizer's longest string): refused
    before tokenizing and before the weights. Characters only bound tokens from below: a prompt of more characters
    than the context has positions, but fewer tokens, still runs."""
    code, out, err = run(["generate", "-m", str(corrupt)], capsys, stdin="word " * 2_000_000, monkeypatch=monkeypatch)
    one_error(code, out, err, "the prompt has 10,000,000 characters", "shorten the prompt")
    fits = "Count " * 700  # 4,200 characters, 1,400-odd tokens: over 4,032 positions in characters only
    code, out, err = run(["generate", "--blocks", "1"], capsys, stdin=fits, monkeypatch=monkeypatch)
    assert code == 0 and out.strip(), err


# --- item 8: smaller -------------------------------------------------------------------------------------------

def test_nan_weights_are_named_corrupt_not_answered(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "nan"
    shutil.copytree(BUNDLED, d)
    w = load_file(str(BUNDLED / "model.safetensors"))
    w["model.decoder.layers.0.self_attn.q_proj.weight"][:] = float("nan")
    save_file(w, str(d / "model.safetensors"))
    one_error(*run(["generate", "-m", str(d), "Reverse: c a t"], capsys), "NaN/Inf logits", "corrupt")


def test_q4_k_m_on_rows_of_160_says_which_types_it_fell_back_to(tmp_path, capsys):
    code, out, err = run(["quantize", str(BUNDLED), str(tmp_path / "t.gguf"), "--type", "q4_k_m"], capsys)
    assert code == 0 and out.count("\n") == 1, err
    notes = [ln for ln in err.splitlines() if ln.startswith("dgemma: note:")]
    assert len(notes) == 1 and "Q4_K -> Q5_0" in notes[0] and "160" in notes[0] and "256" in notes[0], err


def test_small_bad_inputs_are_one_line_naming_the_real_problem(tmp_path, capsys, monkeypatch, corrupt):
    one_error(*run(["generate", "-m", str(tmp_path / "missing.gguf"), "hi"], capsys), "missing.gguf: no such file")
    line = one_error(*run(["generate", "--preset", "/dev/null", "hi"], capsys), "/dev/null", "not a regular file")
    assert "not found" not in line
    code, out, err = run(["generate"], capsys, stdin="Reverse: c a t\x00\x01\x02", monkeypatch=monkeypatch)
    one_error(code, out, err, "NUL byte")
    # an empty key would start an open server: refused before the (garbage) weights are read
    r = dgemma("serve", "-m", str(corrupt), "--port", "0", "--api-key", "", timeout=60)
    one_error(r.returncode, r.stdout, r.stderr, "--api-key is empty")


def test_a_resumed_sweep_with_nothing_left_says_so_and_measures_nothing(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    argv = ["sweep", "--diffusion-steps", "2", "--num-prompts", "2", "--runs", "1", "--warmup", "0", "-o", str(rows)]
    code, out, err = run([*argv, "--no-measure-peaks"], capsys)
    assert code == 0 and "# dgemma sweep" in out, err
    before = rows.read_text()
    code, out, err = run([*argv, "--resume"], capsys)
    assert code == 0 and out == "", out  # no card, no peaks, no table
    assert "nothing left to run: all 1 cell(s) are already in" in err and rows.read_text() == before


def test_an_empty_completion_says_why_in_the_response():
    """The bundled (chat-trained) model answers a raw /v1/completions prompt with padding: the client, not only
    the server log, learns why; the official client still parses the response."""
    import openai

    from dgcli.runtime.session import open_session
    from server_proc import in_process

    with in_process(open_session(None, None, {}), slots=1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt="Reverse: c a t")
        assert r.choices[0].text == "" and "use /v1/chat/completions" in r.model_extra["dgemma_note"]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Reverse: c a t"}])
        assert chat.choices[0].message.content == "t a c" and "dgemma_note" not in chat.model_extra


def test_watch_shows_its_loading_line_before_importing_torch():
    """On a terminal the first feedback comes before the seconds torch's import takes."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = subprocess.Popen([DGEMMA, "watch", "--step-delay", "0", "Reverse: c a t"], stdin=slave, stdout=slave,
                         stderr=slave, env={**env, "PYTHONPROFILEIMPORTTIME": "1", "TERM": "xterm-256color"})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert p.wait(timeout=120) == 0
    screen = b"".join(chunks).decode("utf-8", "replace")
    torch_at = TORCH_IMPORT.search(screen.replace("\r", ""))
    assert torch_at is not None, screen[-2000:]
    assert "loading the model" in screen.replace("\r", "")[:torch_at.start()], "the loading line came after torch"


def _child_memory_cgroup(limit: int) -> Path | None:
    """A child of this process's memory cgroup (v1's memory controller or v2) limited to `limit` bytes; None where
    this machine does not let us make one (not root, no writable memory controller)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")), None)
    base, knob = (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes") if v1 is not None else \
        (Path("/sys/fs/cgroup"), "memory.max")
    parent = base / (v1 if v1 is not None else next(ln[3:] for ln in lines if ln.startswith("0::"))).lstrip("/")
    try:
        child = parent / f"dgemma-test-{os.getpid()}"
        child.mkdir()
        (child / knob).write_text(str(limit))
    except OSError:
        return None
    return child


def test_slots_beyond_a_memory_cap_are_refused_under_it(corrupt):
    """Under a cgroup's memory limit (a container's, `systemd-run -p MemoryMax=`), MemAvailable still counts the
    whole machine: 1,000 idle slots (~3.4 GiB of KV cache) pass that check here and then the load fails on the
    garbage weights; under a 1 GiB cap the same command is refused first, naming the cap."""
    free = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()}
    if free["MemAvailable"] < 6 * 2**30:
        pytest.skip("needs 6 GiB available to tell a cap's refusal from the machine's")
    uncapped = dgemma("serve", "-m", str(corrupt), "--max-batch-size", "1000", "--port", "1")
    assert uncapped.returncode != 0 and "--max-batch-size" not in uncapped.stderr, uncapped.stderr
    group = _child_memory_cgroup(2**30)
    if group is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable memory controller)")
    try:
        capped = subprocess.run(
            [DGEMMA, "serve", "-m", str(corrupt), "--max-batch-size", "1000", "--port", "1"], capture_output=True,
            text=True, timeout=120, preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        group.rmdir()
    line = one_error(capped.returncode, capped.stdout, capped.stderr, "--max-batch-size 1000:", "memory cap of 1.0 GiB")
    assert 0 < int(re.search(r"at most ([\d,]+) fit", line).group(1).replace(",", "")) < 1000
