"""The engine thread: one `LLMEngine` owned by one thread, fed through an inbox, its events turned into each
request's messages on the HTTP side's event loop.

Owns: `Job` (a request as the thread sees it: `Spec`, `Output`, the handler's asyncio queue) and `Worker`
(submit / cancel / abort from any thread). Messages to a handler: ("text", reasoning, content) per committed
block, ("draft", dict) per step when asked, then ("end", finish_reason, usage, note on an empty answer or None)
or ("error", ApiError). An answer ended early (stop string, max_tokens) or a client gone frees its slot at once;
`abort` answers every waiting request (503) from the calling thread: a shutdown never waits on a pass. Progress
goes to `Metrics` so that /health tells a stalled engine from a busy one.
Must not: parse HTTP, touch sockets, or reach into the engine's parts; only this thread touches the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dgcli.engine import LLMEngine, Output, new_engine
from dgcli.errors import UserError
from dgcli.sampling import host_reads
from dgcli.sampling.events import BlockStart, Commit, Done, Step
from dgcli.serve.metrics import Metrics
from dgcli.serve.errors import ApiError
from dgcli.serve.protocol import Spec, usage

log = logging.getLogger("dgemma.serve")
SHUTTING_DOWN = "the server is shutting down; retry on another server"


@dataclass
class Job:
    spec: Spec
    output: Output
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    id: int = -1
    started: bool = False  # holds a slot
    steps_per_block: list[int] = field(default_factory=list)
    submitted: float = 0.0  # time.monotonic() when the worker accepted it (the latency histograms' start)
    first_block: bool = False  # its first block's tokens are out (time to first token observed)

    def send(self, *message: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, message)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


class Worker:
    def __init__(self, session: Any, *, slots: int, max_len: int, metrics: Metrics):
        self.session, self.slots, self.max_len, self.metrics = session, slots, max_len, metrics
        self.engine = self._engine()
        self.prefix_base = (0, 0)  # prefix-cache totals of engines replaced after a failure: /metrics goes on
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict[int, Job] = {}
        self.ids = itertools.count()
        # Jobs not yet answered, shared with `abort` (any thread): whoever removes a job sends its last message.
        self.lock = threading.Lock()
        self.live: dict[int, Job] = {}
        self.closed = False
        self.drafts: list[_Draft] = []  # drafts on their way to the host (CUDA: sent a pass later)
        self.thread = threading.Thread(target=self._run, name="dgemma-engine", daemon=True)

    def _engine(self) -> LLMEngine:
        s = self.session
        return new_engine(s.model, slots=self.slots, max_len=self.max_len, pad_id=s.pad_id, compile_tiles=s.compiled,
                          step_mode=s.step_mode, prefix_caching=getattr(s, "prefix_caching", True))

    # ---- any thread --------------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        job.id = next(self.ids)
        job.submitted = time.monotonic()
        with self.lock:
            if self.closed:  # admitted just before the shutdown: nobody will run it
                job.send("error", ApiError(503, SHUTTING_DOWN))
                return
            self.live[job.id] = job
        with self.metrics.lock:
            self.metrics.queued += 1
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def abort(self) -> None:
        """Answer every request 503 from here at once (the engine thread may be in a long pass) and stop the thread
        when it next reads its inbox."""
        with self.lock:
            self.closed = True
            jobs, self.live = list(self.live.values()), {}
        for job in jobs:
            job.send("error", ApiError(503, SHUTTING_DOWN))
        self.inbox.put(("close", None))

    def close(self, timeout: float) -> bool:
        """`abort`, then wait up to `timeout` s for the thread; False when it is still in a pass (left behind)."""
        self.abort()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    # ---- the engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.session.threads or torch.get_num_threads())  # per thread under OpenMP
        while True:
            idle = self.engine.idle
            self.metrics.engine_progress(waiting=idle)  # a pass (or the start) is done
            try:  # every message waiting (idle: at least one), then a pass
                message = self.inbox.get(block=idle)
                while True:
                    self.metrics.engine_progress(waiting=False)  # the clock runs from here while it handles it
                    if not self._handle(*message):
                        return
                    message = self.inbox.get_nowait()
            except queue.Empty:
                pass
            if not self.engine.idle:
                self._pass()

    def _handle(self, kind: str, job: Job | None) -> bool:
        if kind == "submit":
            spec = job.spec
            self.jobs[job.id] = job
            try:  # anything that fails here fails this request alone: the thread must outlive it
                self.engine.add_request(spec.prompt_ids, request_id=job.id, params=spec.params,
                                        num_blocks=spec.num_blocks, seed=spec.params.seed,
                                        stop_ids=() if spec.ignore_eos else self.session.stop_ids,
                                        constraint=spec.fmt.constraint() if spec.fmt else None, images=spec.images)
            except Exception as e:  # the engine refused it (the app's checks should have caught this)
                log.exception("the engine refused request %s", job.id)
                status = 400 if isinstance(e, UserError) else 500
                self._forget(job, cancelled=False, last=("error", ApiError(status, str(e))))
        elif kind == "cancel":
            if job.id in self.jobs:
                self.engine.cancel(job.id)
                self._forget(job, cancelled=True)
        else:  # close: `abort` has answered every job
            for j in list(self.jobs.values()):
                self.engine.cancel(j.id)
                self._forget(j, cancelled=True)
            return False
        return True

    def _pass(self) -> None:
        stats = self.engine.stats
        before = stats["denoise_s"]
        earlier = {id(d) for d in self.drafts}
        try:
            for event in self.engine.step():
                self._dispatch(event)
            # The previous pass's drafts now (their copies finished with that pass); all once the engine is idle.
            self._flush_drafts(lambda d: self.engine.idle or id(d) in earlier)
        except Exception:  # a bug or out of memory: fail the running requests, keep serving
            log.exception("the engine failed; its requests get an error and a new engine takes over")
            failed = ApiError(500, "the engine failed on this request's batch; see the server log")
            for j in list(self.jobs.values()):
                self._forget(j, cancelled=False, last=("error", failed))
            self.engine = None  # free the old cache before the new one is allocated
            self.engine = self._engine()
            m = self.metrics  # the counters go on from the old engine's totals
            self.prefix_base = (m.prefix_cache_queries, m.prefix_cache_hits)
            return
        if stats["denoise_s"] > before:
            self.metrics.observe(self.metrics.pass_latency, stats["denoise_s"] - before)
        self.metrics.prefix_cache(self.prefix_base[0] + stats.get("prefix_cache_queries", 0),
                                  self.prefix_base[1] + stats.get("prefix_cache_hits", 0))

    def _forget(self, job: Job, *, cancelled: bool, last: tuple | None = None) -> None:
        """Drop `job` from the books; `last` is its final message, sent unless `abort` has answered it."""
        self.jobs.pop(job.id, None)
        self.drafts = [d for d in self.drafts if d.job is not job]
        with self.lock:
            unanswered = self.live.pop(job.id, None) is not None
        if last is not None and unanswered:
            job.send(*last)
        with self.metrics.lock:
            if job.started:
                self.metrics.running -= 1
            else:
                self.metrics.queued -= 1
            self.metrics.cancelled += cancelled

    def _end(self, job: Job) -> None:
        out, spec = job.output, job.spec
        note = None
        if not (out.sent_content.strip() or out.sent_reasoning.strip()):  # the client got "": say why, to it too
            why = ("/v1/completions sends the prompt without the chat template, and a chat-trained checkpoint "
                   "answers such prompts with padding; use /v1/chat/completions" if not spec.chat else
                   "the model gave no text for these messages")
            log.warning("dgemma serve: request %s: the answer is empty (%s)", job.id, why)
            note = f"the answer is empty: {why}"
        use = usage(len(spec.prompt_ids), out.completion_tokens, job.steps_per_block)
        self.metrics.observe(self.metrics.e2e, time.monotonic() - job.submitted)
        self._forget(job, cancelled=False, last=("end", out.finish_reason, use, note))

    def _dispatch(self, event: Any) -> None:
        job = self.jobs.get(event.row)
        if job is None:  # withdrawn: its last events of the pass are dropped
            return
        if isinstance(event, BlockStart):
            if not job.started:
                job.started = True
                with self.metrics.lock:
                    self.metrics.queued -= 1
                    self.metrics.running += 1
        elif isinstance(event, Step):
            if event.stop_reason is not None:
                job.steps_per_block.append(event.step)
            if job.spec.include_drafts:
                d = _Draft.copy(job, event)
                self.drafts.append(d) if d.done is not None else self._send_draft(d)
        elif isinstance(event, Commit):
            self._flush_drafts(lambda d: d.job is job)  # a block's drafts before its text
            if not job.first_block:
                job.first_block = True
                self.metrics.observe(self.metrics.ttft, time.monotonic() - job.submitted)
            self.metrics.block(job.steps_per_block[-1], len(event.tokens) if event.stop_index is None else event.stop_index)
            reasoning, content = job.output.commit(event.tokens, event.stop_index)
            if reasoning or content:
                job.send("text", reasoning, content)
            if job.output.finish_reason is not None:
                engine_ends = event.stop_index is not None or event.block + 1 >= job.spec.num_blocks
                if not engine_ends:  # a stop string or max_tokens ended it first: free the slot now
                    self.engine.cancel(job.id)
                    with self.metrics.lock:
                        self.metrics.cancelled += 1
                self._end(job)
        elif isinstance(event, Done):
            self._flush_drafts(lambda d: d.job is job)
            reasoning, content = job.output.finish(event.finish_reason)
            if reasoning or content:
                job.send("text", reasoning, content)
            self._end(job)

    def _flush_drafts(self, which: Callable[[_Draft], bool]) -> None:
        """Send the drafts on their way that `which` picks, in order (waiting for their copies)."""
        send = [d for d in self.drafts if which(d)]
        self.drafts = [d for d in self.drafts if not which(d)]
        for d in send:
            self._send_draft(d)

    def _send_draft(self, d: _Draft) -> None:
        if d.done is not None:
            d.done.synchronize()
        flat = host_reads.read(d.values, "draft")
        c, event, tok = d.event.argmax.numel(), d.event, self.session.tokenizer
        ids = [int(i) for i in flat[:c]]
        draft = {
            "block": event.block, "step": event.step, "max_steps": event.max_steps, "token_ids": ids,
            "text": tok.decode(ids), "accepted": [a != 0 for a in flat[c:2 * c]],
            "mean_entropy": round(flat[-1], 6), "final": event.stop_reason is not None, "time": time.time(),
            # Per position, for a client that draws the canvas (the web page): no tokenizer needed there.
            "tokens": tok.token_strings(ids), "entropy": [round(e, 6) for e in flat[2 * c:3 * c]]}
        if event.stop_reason is not None:  # the block's ids as tokens_per_forward counts them: padding is no output
            stops = () if d.job.spec.ignore_eos else self.session.stop_ids
            end = next((i + 1 for i, t in enumerate(ids) if t in stops), c)  # up to and including a stop id
            draft["committed"] = sum(t != self.session.pad_id for t in ids[:end])
        d.job.send("draft", draft)


@dataclass
class _Draft:
    """One step's draft: ids, accepted mask, entropies and their mean in one float64 host tensor (exact for each).
    On CUDA the copy does not wait (pinned, an event behind it): the draft is sent after the next pass is launched,
    or before its request's next text, so a client watching the canvas never makes the device wait."""

    job: Job
    event: Step
    values: torch.Tensor
    done: Any  # torch.cuda.Event, None when `values` is already on the host

    @classmethod
    def copy(cls, job: Job, event: Step) -> _Draft:
        parts = (event.argmax, event.accepted_mask, event.entropy, torch.as_tensor(event.mean_entropy))
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts])
        if flat.device.type != "cuda":
            return cls(job, event, flat, None)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(job, event, host, done)
