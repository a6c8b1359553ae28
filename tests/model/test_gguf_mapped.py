"""A GGUF model's weights used from files' maps, as a process sees its own memory: after loading a Q4_K_M file
and running a pass, its anonymous memory (RssAnon) holds a small fraction of the file's quantized bytes while its
file-backed memory (RssFile) covers them, on the first load (which writes the kernels' form to a cache file) and
on a later one (which maps it), Q5_0 / Q8_0 / Q6_K blocks resident in the GGUF file's own map (no cached copy); the
low-memory mode (`low_memory=True`, the CLI's --low-memory) leaves few of
those pages resident after a pass and gives the same logits. Fresh child processes: each measures from a
baseline taken after its imports."""

import json
import math
import subprocess
import sys

import pytest

from dgcli.checkpoint.config import read_json
from dgcli.checkpoint.gguf import GGUFFile
from dgcli.checkpoint.random_weights import write_random_gguf
from dgcli.model import ggml
from dgcli.runtime.session import BUNDLED

pytestmark = pytest.mark.slow  # ~100 MB written, three child processes: ~20 s on two shared cores

CHILD = r"""
import hashlib, json, sys, torch
import dgcli
torch.set_num_threads(1)
def rss():
    f = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("Rss")}
    return f["RssAnon"], f["RssFile"]
a0, f0 = rss()
s = dgcli.open_session(sys.argv[1], need_tokenizer=False, low_memory=sys.argv[2] == "low" or None)
m, g = s.model, torch.Generator().manual_seed(0)
with torch.inference_mode():
    for _ in range(2):
        y = m.forward_canvas(torch.randint(0, 256, (2, 9), generator=g),
                             torch.randint(0, 256, (2, m.config.canvas_length), generator=g))
a1, f1 = rss()
gguf, path = 0, None  # resident bytes of the GGUF file's own mappings
for l in open("/proc/self/smaps"):
    if "-" in l.split()[0] and l.split()[0][0] in "0123456789abcdef" and not l.startswith("Rss"):
        path = l.split()[5] if len(l.split()) > 5 else None
    elif l.startswith("Rss:") and path == sys.argv[1]:
        gguf += int(l.split()[1]) * 1024
print(json.dumps({"anon": a1 - a0, "file": f1 - f0, "gguf": gguf,
                  "logits": hashlib.sha256(y.float().numpy().tobytes()).hexdigest()}))
"""


def _q4_k_m(folder, inter: int):
    raw = read_json(BUNDLED / "config.json")
    t = raw["text_config"]
    t.update(hidden_size=512, intermediate_size=inter, moe_intermediate_size=inter, num_experts=48, top_k_experts=8,
             vocab_size=2048, num_hidden_layers=4, head_dim=128, global_head_dim=256,
             layer_types=["sliding_attention"] * 3 + ["full_attention"])
    path = folder / "random-q4_k_m.gguf"
    write_random_gguf(raw, None, path, "q4_k_m")
    return path


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    return _q4_k_m(tmp_path_factory.mktemp("mapped"), 512)


@pytest.fixture(scope="module")
def q5_file(tmp_path_factory):
    """Down projections of rows of 352 values (not a multiple of 256): Q5_0 in layers 0-1, Q8_0 in the "more bits"
    layers 2-3 (where Q4_K_M asks for Q6_K), as llama.cpp falls back (the 26B-A4B's 704 and 2112)."""
    return _q4_k_m(tmp_path_factory.mktemp("mapped5"), 352)


def child(path, mode: str = "plain", *extra) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, str(path), mode, *extra], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]), stderr=p.stderr)


def quantized_bytes(path) -> int:
    return sum(t.nbytes for t in GGUFFile(path).tensors.values() if t.type in ggml.QUANTIZED)


def test_quantized_weights_stay_in_files_not_anonymous_memory(q4_file):
    q = quantized_bytes(q4_file)
    assert q > 80 * 2**20  # temporaries and kernel scratch are ~25 MB at any size: the bound means something
    first, again = child(q4_file), child(q4_file)  # the first writes the cache file, the second maps it
    for run in (first, again):
        # Before: the Q4_K matrices repacked into anonymous memory (~1.1x their bytes; the embedding, its bf16 form)
        assert run["anon"] < 0.35 * q, (first, again, q)
        assert run["file"] > 0.8 * q, (run["file"], q)
    assert first["logits"] == again["logits"]


def test_low_memory_mode_streams_the_layers_and_changes_no_bit(q4_file):
    plain, low = child(q4_file), child(q4_file, "low")
    assert low["logits"] == plain["logits"]
    assert "low-memory mode: 4 of 4 layers read from disk each step" in low["stderr"], low["stderr"]
    # Each layer's pages are given back as the next one starts: of 4 layers, the last stays (+ the embedding)
    assert plain["file"] - low["file"] > 0.5 * quantized_bytes(q4_file), (low["file"], plain["file"])
    assert "low-memory" not in plain["stderr"]


def test_q5_0_and_q8_0_blocks_are_used_from_the_gguf_files_own_map(q5_file):
    from dgcli.checkpoint.mapped import cache_path
    from dgcli.kernels.ggml_cpu import prepared_bytes

    tensors = GGUFFile(q5_file).tensors
    assert {t.type for t in tensors.values()} >= {ggml.Q5_0, ggml.Q8_0, ggml.Q4_K, ggml.Q6_K}
    stored = sum(t.nbytes for n, t in tensors.items()  # the embedding (Q6_K) is used dequantized, from the cache
                 if t.type in (ggml.Q5_0, ggml.Q8_0, ggml.Q6_K) and n != "token_embd.weight")
    first, again = child(q5_file), child(q5_file)  # the first writes the cache file, the second maps it
    for run in (first, again):
        assert run["anon"] < 0.35 * quantized_bytes(q5_file), run
        # Before: the Q5_0 / Q8_0 matrices were read from a cached copy (two int4 planes, 1.6x / 1.1x their bytes)
        assert run["gguf"] >= 0.95 * stored, (run["gguf"], stored)
    assert first["logits"] == again["logits"]
    # The cache file beside the GGUF holds the int4 form of the Q4_K matrices and the dequantized embedding only
    int4 = sum(math.prod(t.shape[:-2]) * prepared_bytes(t.type, *t.shape[-2:])
               for t in tensors.values() if t.type == ggml.Q4_K)
    embedding = math.prod(tensors["token_embd.weight"].shape) * 2
    assert cache_path(q5_file, "bfloat16").stat().st_size <= int4 + embedding + 4096 * (len(tensors) + 2)
