"""A CPU session in bf16 prepacks its weights for oneDNN (dgcli/model/packed.py) and gives every request exactly
the events of the same session unpacked, on the bundled model's held-out prompts; in fp32 it packs for the C
GEMM (kernels/gemm_native.py; not with DGEMMA_KERNELS=torch); nothing packs under --compile or with
DGEMMA_KERNELS=reference; bench's provenance says which linear ran."""

from __future__ import annotations

import json

import pytest
from test_engine_lag import mixed_jobs, per_request

import dgcli
from dgcli.cli.options import sampler_flags
from dgcli.kernels import gemm_native, linear_cpu
from dgcli.model import packed as packed_mod
from dgcli.model.packed import NativeExperts, NativeLinear, PackedLinear
from dgcli.runtime import request
from dgcli.runtime.session import open_session
from dgcli.text.prompts import read_prompt_file

pytestmark = pytest.mark.skipif(not linear_cpu.packing_available(),
                                reason="this torch build has no oneDNN bf16 packed linear")


def bf16_session(**kw):
    return open_session(None, None, sampler_flags(blocks=4, seed=0, device="cpu", dtype="bfloat16"), **kw)


@pytest.fixture(scope="module")
def sessions():
    """The bundled model in bf16, packed as a session packs it and left as loaded; held-out prompts."""
    packed = bf16_session()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_mod, "pack_for_cpu", lambda model: 0)
        plain = bf16_session()
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")
    return packed, plain, [request.encode(packed, row["prompt"]) for row in rows]


def test_a_bf16_cpu_session_packs(sessions):
    packed, plain, _ = sessions
    assert packed.packed_weights > 0 and plain.packed_weights == 0
    assert any(type(m) is PackedLinear for m in packed.model.modules())


@pytest.mark.parametrize("slots", [1, 4])
def test_packed_session_gives_every_request_the_same_events(sessions, slots):
    """18 held-out prompts through `slots` slots, then mixed settings with a cancel at lag 1:
    tokens, masks, steps and mean entropies all equal (the same bits, not within a tolerance)."""
    packed, plain, prompts = sessions
    jobs = [(prompts[i], packed.params, 4) for i in range(0, 90, 5)]
    a, _ = per_request(0, packed, jobs, slots)
    b, _ = per_request(0, plain, jobs, slots)
    assert a == b
    a, _ = per_request(1, packed, mixed_jobs(packed, prompts), 3, (2, 3))
    b, _ = per_request(1, plain, mixed_jobs(plain, prompts), 3, (2, 3))
    assert a == b


def test_fp32_packs_for_the_c_gemm_and_nothing_packs_under_compile_or_on_the_references(monkeypatch):
    fp32 = open_session(None, None, sampler_flags(blocks=1, device="cpu", dtype="float32"))
    native = [m for m in fp32.model.modules() if isinstance(m, (NativeLinear, NativeExperts))]
    if gemm_native.available():  # fp32: the C GEMM's panels (every linear and the experts of every layer)
        assert fp32.packed_weights > 0 and len(native) > len(fp32.model.layers)
    else:
        assert fp32.packed_weights == 0 and not native
    with monkeypatch.context() as m:
        m.setenv("DGEMMA_KERNELS", "torch")
        assert open_session(None, None, sampler_flags(blocks=1, device="cpu", dtype="float32")).packed_weights == 0
    assert bf16_session(compile=True).packed_weights == 0  # inductor traces the weights as loaded
    monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    assert bf16_session().packed_weights == 0
    assert open_session(None, None, sampler_flags(blocks=1, device="cpu", dtype="float32")).packed_weights == 0


def test_bench_provenance_names_the_linear_that_ran(cli_ckpt, monkeypatch):
    from typer.testing import CliRunner

    from dgcli.cli import app

    kinds, fp32 = {}, "c-panels" if gemm_native.available() else "torch.linear"  # fp32: the C GEMM where it builds
    for dtype in ("bfloat16", "float32", "float32-torch"):
        if dtype == "float32-torch":
            monkeypatch.setenv("DGEMMA_KERNELS", "torch")
        r = CliRunner().invoke(app, ["bench", "--model", str(cli_ckpt), "--dtype", dtype.removesuffix("-torch"),
                                     "--diffusion-steps", "2",
                                     "--confidence-threshold", "0", "--blocks", "1", "--random-prompts",
                                     "--num-prompts", "1", "--random-input-len", "6", "--no-measure-peaks",
                                     "--runs", "1", "--warmup", "0", "--format", "jsonl"])
        assert r.exit_code == 0, (r.output, r.exception)
        kinds[dtype] = json.loads(r.stdout)["provenance"]["kernels"]["linear"]
    assert kinds == {"bfloat16": "onednn-packed", "float32": fp32, "float32-torch": "torch.linear"}
