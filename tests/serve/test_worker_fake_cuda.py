"""`dgemma serve`'s engine thread on fake CUDA (tests/fake_cuda.py): the worker's own work around the engine —
taking a request in, dispatching each pass's events, the drafts a client asked for — runs on a model whose
weights are fake `cuda:0` tensors, and fails on a host read that is not declared (`sampling/host_reads.py`),
a device mix, or a host-to-device copy that would wait for the pass in flight.

The worker is driven from the test's thread (`_handle`, `_pass`: what its thread runs), since the fake mode
is per thread; its messages go through a real asyncio loop, as to the HTTP side.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from dgcli.runtime.session import Session, default_model_path
from dgcli.sampling import host_reads
from dgcli.sampling.params import DiffusionEbParams
from dgcli.serve.metrics import Metrics
from dgcli.engine import Output
from dgcli.serve.protocol import Spec
from dgcli.serve.worker import Job, Worker
from dgcli.text.tokenizer import load_tokenizer
from fake_cuda import CUDA, PROMPT_LENS, AttentionLog, CudaBindings, OpLog, check_dtypes, fake_cuda, fake_model  # noqa: F401
from fake_cuda import PageableCopies, substitute_reads


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def fake_session(model, tokenizer) -> Session:
    resolved = type("Resolved", (), {"params": DiffusionEbParams()})()
    return Session(default_model_path(), model.config, model, tokenizer, resolved, CUDA,
                   stop_ids=[tokenizer.eos_id], num_blocks=2, name="fake", threads=1)


def drive(mode, session, drafts: bool):
    """Four chat requests of different lengths through a worker with 2 slots; the messages each job got."""
    loop = asyncio.new_event_loop()
    reads, log = [], OpLog()
    params = DiffusionEbParams(max_denoising_steps=4, confidence_threshold=0.5)
    try:
        with mode, CudaBindings(), PageableCopies() as copies:
            worker = Worker(session, slots=2, max_len=64, metrics=Metrics(2))
            assert worker.engine.lag == 1  # what a CUDA model gets
            jobs = []
            for n in PROMPT_LENS:
                spec = Spec(chat=True, prompt_ids=list(range(3, 3 + n)), params=params, num_blocks=2,
                            max_tokens=None, include_drafts=drafts, ignore_eos=True)
                job = Job(spec, Output(session.tokenizer), loop, asyncio.Queue())
                worker.submit(job)
                jobs.append(job)
            with host_reads.substituted(substitute_reads(reads)), log, AttentionLog(log):
                passes = 0
                while True:
                    while not worker.inbox.empty():
                        assert worker._handle(*worker.inbox.get_nowait())
                    if worker.engine.idle:
                        break
                    worker._pass()
                    passes += 1
                    assert passes < 200
        loop.run_until_complete(asyncio.sleep(0))  # deliver what the worker sent
        messages = []
        for job in jobs:
            got = []
            while not job.queue.empty():
                got.append(job.queue.get_nowait())
            messages.append(got)
        return messages, reads, log, copies
    finally:
        loop.close()


@pytest.mark.parametrize("drafts", [pytest.param(False, marks=pytest.mark.slow), True])
def test_serve_worker_runs_on_fake_cuda(fake_cuda, tokenizer, caplog, drafts):
    session = fake_session(fake_model(fake_cuda, "bf16"), tokenizer)
    with caplog.at_level(logging.ERROR, logger="dgemma.serve"):
        messages, reads, log, copies = drive(fake_cuda, session, drafts)
    assert not caplog.records, caplog.text  # the worker logs (and swallows) an engine failure: none here
    for got in messages:
        kinds = [m[0] for m in got]
        assert kinds[-1] == "end" and "error" not in kinds, got
        steps = [m[1] for m in got if m[0] == "draft"]
        if drafts:  # every step's draft, in order, before the answer ends
            assert steps and [(d["block"], d["step"]) for d in steps] == sorted((d["block"], d["step"]) for d in steps)
            assert all(len(d["token_ids"]) == len(d["entropy"]) == session.config.canvas_length for d in steps)
        else:
            assert not steps
    assert {why for why, *_ in reads} == ({"stop", "commit", "draft"} if drafts else {"stop", "commit"})
    # drafts come off the device through a pinned copy made without waiting, as the stop flags do
    assert all(dev.type == "cpu" for why, _, _, dev in reads if why in ("stop", "draft"))
    assert not copies.found, "\n".join(copies.found)
    check_dtypes(log, "bf16")


def test_a_pageable_copy_when_a_request_joins_is_caught(fake_cuda, tokenizer, monkeypatch):
    """A planted `torch.tensor(host values, device=cuda)` when the engine takes a request in (a copy from
    pageable memory, which waits for the pass in flight) is found."""
    from dgcli.engine import llm_engine as engine

    monkeypatch.setattr(engine, "to_device", lambda values, dtype, device: torch.as_tensor(values, dtype=dtype).to(device))
    session = fake_session(fake_model(fake_cuda, "bf16"), tokenizer)
    _, _, _, copies = drive(fake_cuda, session, drafts=False)
    assert any(f.startswith("Tensor.to(cuda)") and "engine/llm_engine.py" in f for f in copies.found), copies.found
