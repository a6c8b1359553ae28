"""`dgemma bench --dummy` on fake CUDA (tests/fake_cuda.py): warm-up, timed passes, the summary and the row of a
bench run on a model whose weights are fake `cuda:0` tensors (bf16 and FP8), as `cli/bench.py` runs them. It
fails on a host read that is not declared, a device mix, a host-to-device copy that waits, a GEMM in a dtype
the CUDA path must not use, and on any tensor in what the bench records (a row is plain numbers and text:
a device value there would be read back whenever the row is printed).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dgcli.measure import bench as b
from dgcli.measure import metrics
from dgcli.measure.workload import build_prompts
from dgcli.runtime.session import Session, ran_with
from dgcli.runtime.settings import resolve
from dgcli.sampling import host_reads
from dgcli.checkpoint.random_weights import reference_generation_config
from fake_cuda import (CANVAS, CUDA, AttentionLog, CudaBindings, OpLog, PageableCopies, check_dtypes,  # noqa: F401
                       fake_cuda, fake_model, substitute_reads)


def leaves(x, path="row"):
    """(path, value) of every leaf of a record (dicts, lists, tuples, dataclasses)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return [leaf for k, v in x.items() for leaf in leaves(v, f"{path}.{k}")]
    if isinstance(x, (list, tuple)):
        return [leaf for i, v in enumerate(x) for leaf in leaves(v, f"{path}[{i}]")]
    return [(path, x)]


@pytest.mark.parametrize("weights", ["bf16", pytest.param("fp8", marks=pytest.mark.slow)])
def test_bench_dummy_runs_on_fake_cuda(fake_cuda, monkeypatch, weights):
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    model = fake_model(fake_cuda, weights)
    flags = {"max_denoising_steps": 4, "confidence_threshold": 0.0, "max_blocks": 2}
    resolved = resolve(reference_generation_config(CANVAS), None, flags)
    session = Session(Path(__file__), model.config, model, None, ran_with(resolved, model), CUDA, stop_ids=[1],
                      num_blocks=2, name="dummy fake", dummy=True, threads=1)
    prompts, source = build_prompts(session, prompts_file=None, random_ids=True, num_prompts=3, input_len=7,
                                    seed=0, warn=lambda _: None)
    reads, log = [], OpLog()
    with fake_cuda, CudaBindings(), PageableCopies() as copies:
        with host_reads.substituted(substitute_reads(reads)), log, AttentionLog(log):
            memory = b.PeakMemory(session.device, 0)
            passes = b.measure(session, prompts, session.params, runs=1, warmup=1, ignore_eos=True, batch_size=2,
                               memory=memory)
        peaks = b.device_peaks(session.device)
        summary = metrics.summarize(passes, session.config, 4, weight_bytes=b.weight_bytes(session), peaks=peaks,
                                    peak_memory=memory.read())
        row = b.make_row(session, prompts=prompts, prompt_source=source, params=session.params, runs_done=1,
                         runs_asked=1, warmup=1, ignore_eos=True, summary=summary, label=None, metadata={})
    assert not copies.found, "\n".join(copies.found)
    assert {why for why, *_ in reads} <= {"stop", "commit"} and any(why == "commit" for why, *_ in reads)
    check_dtypes(log, weights)
    tensors = [(p, v) for p, v in leaves([row, passes]) if isinstance(v, torch.Tensor)]
    assert not tensors, tensors[:5]
    assert row["provenance"]["device"].startswith("cuda") and row["peak_memory_bytes"] == 123 << 20
    assert row["batch_size"] == 2 and len(passes[0].responses) == 3
