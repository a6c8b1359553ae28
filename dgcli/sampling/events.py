"""Typed events of the one denoising loop (`dgcli.engine.generate_events`) and their JSON records.

Owns: the event dataclasses and `to_record()`, the JSON-ready dict each becomes in a trace (one
line per record; `BlockStart` and `Step` records are per block/step, `Commit` per block, `Done`
last). The trace header (model, settings, prompt ids) is the trace writer's, not ours.
Must not: run the model, sample, time anything, or write files. Tensors inside events may live on
the device; they are only turned into Python values when a consumer asks (`to_record`), so the
loop itself never waits for them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Union

import torch

StopReason = Literal["stable_confident", "step_cap"]
FinishReason = Literal["stop", "length"]


class _Record:
    TYPE: ClassVar[str]

    def to_record(self) -> dict:
        """Every field but `row` (a trace holds one request), tensors as lists."""
        out = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            if f.name != "row":
                v = getattr(self, f.name)
                out[f.name] = v.tolist() if isinstance(v, torch.Tensor) else copy.copy(v)
        return out


@dataclass
class BlockStart(_Record):
    """A block's denoising begins from `canvas` (uniform-random ids, or the user's initial canvas)."""

    block: int  # 0-based
    num_blocks: int  # the most blocks this generation may produce
    prefix_len: int  # tokens in the cache before this block (prompt + committed blocks)
    canvas: torch.Tensor  # [C] int64
    row: int = 0  # the request's index in a batch (not recorded: a trace holds one request)
    TYPE: ClassVar[str] = "block_start"


@dataclass
class Step:
    """One denoising step (one decoder pass) of block `block`."""

    block: int  # 0-based
    step: int  # 1-based: 1 is the first step of the block (the reference's n = N)
    max_steps: int  # N
    temperature: float  # T_n used for this step's processed logits
    canvas_in: torch.Tensor  # [C] int64: the canvas the decoder saw
    argmax: torch.Tensor  # [C] int64: argmax of the processed logits; the block output if it stops here
    sample: torch.Tensor  # [C] int64: the categorical draw per position
    accepted_mask: torch.Tensor  # [C] bool: positions that keep their sample
    accepted_count: torch.Tensor  # 0-dim int64
    entropy: torch.Tensor  # [C] float32, nats, of the tempered distribution
    mean_entropy: torch.Tensor  # 0-dim float32: what the confidence rule compares
    next_canvas: torch.Tensor  # [C] int64: sample where accepted, fresh uniform ids elsewhere
    stop_reason: StopReason | None  # set on the block's last step
    elapsed_s: float  # host wall time of the step (the whole batch's), up to and including its stop decision
    row: int = 0

    def to_record(self) -> dict:
        return {
            "type": "step",
            "block": self.block,
            "step": self.step,
            "max_steps": self.max_steps,
            "temperature": round(self.temperature, 6),  # the float32 value printed as set (0.8, not 0.800000012)
            "accepted_count": int(self.accepted_count),
            "mean_entropy": float(self.mean_entropy),
            "canvas": self.canvas_in.tolist(),
            "argmax": self.argmax.tolist(),
            "entropy": self.entropy.float().tolist(),
            "accepted": [int(a) for a in self.accepted_mask.tolist()],
            "stop_reason": self.stop_reason,
            "elapsed_s": self.elapsed_s,
        }


@dataclass
class Commit(_Record):
    """A block is final: `tokens` (its last argmax canvas) join the sequence."""

    block: int  # 0-based
    tokens: list[int]  # all C ids of the block, as appended to the sequence
    stop_index: int | None  # position of the first stop id in `tokens`; generation ends there
    row: int = 0
    TYPE: ClassVar[str] = "commit"


@dataclass
class Done(_Record):
    """The generation's result; also what `dgcli.engine.generate` returns. A block's output is the argmax of its
    last step. `tokens_per_forward` is HF's: generated ids up to and including the stop id, not counting `pad_id`,
    per decoder pass (encoder passes not counted). `timings`, seconds of the engine's own time (a consumer's between
    events excluded; a queued request's include its wait): prefill_s (the passes carrying the prompt, whole),
    denoise_s (the steps up to the block-end read-back), commit_s (encodes of committed blocks), first_block_s
    (submit to the first block's tokens), total_s."""

    token_ids: list[int]  # the answer: generated ids up to, not including, the first stop id (HF keeps it)
    finish_reason: FinishReason  # "stop": a stop id appeared; "length": all blocks ran out
    stop_id: int | None  # the stop id that ended generation (not in token_ids), if any
    blocks: int  # blocks generated
    steps_per_block: list[int]  # decoder passes each block took
    decoder_passes: int  # sum of steps_per_block
    tokens_per_forward: float
    timings: dict[str, float] = field(default_factory=dict)
    row: int = 0
    TYPE: ClassVar[str] = "done"


Event = Union[BlockStart, Step, Commit, Done]
