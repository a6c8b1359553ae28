"""The frames of `dgemma watch`: a run's sampler records folded into what the screen shows, as plain data.

Owns: folding one run's records (`event.to_record()` live, `read_trace`'s in a replay: the same frames by
construction) into `Frame`s and `Committed` blocks, a position's colour class, a token's display string, the
separator between positions and a frame's status line. Must not: import Rich, draw, write, run the model,
tokenize, or read or write traces.

Colour classes (terminal styles, SVG and HTML CSS share the names):
  renoised   the position was not accepted this step: its sample is replaced by noise (dim)
  acc0..acc3 accepted, by the entropy of its distribution: acc3 < 0.001 <= acc2 < 0.01 <= acc1 < 0.1 <= acc0 nats
  changed    its best token differs from the previous step's (first step: from the starting canvas)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

RENOISED = 4  # kind of a position that was renoised; 0..3 are the accepted confidence levels
ENTROPY_EDGES = (1e-1, 1e-2, 1e-3)  # nats; accepted positions below edge i are at least level i + 1
CLASSES = ("acc0", "acc1", "acc2", "acc3", "renoised")  # index = kind
STOP_LABELS = {"stable_confident": "stable+confident", "step_cap": "step cap"}
# Drawn between canvas positions (terminal, SVG, HTML): word pieces of one word would otherwise run
# together and hide where a position ends. Never part of the answer text (`Pieces.text`).
SEPARATOR = "│"


def kind_of(accepted: int, entropy: float) -> int:
    """RENOISED, or the confidence level 0..3 of an accepted position."""
    if not accepted:
        return RENOISED
    return sum(entropy < edge for edge in ENTROPY_EDGES)


def display_piece(piece: str) -> str:
    """A token piece as one canvas cell: visible whitespace, so noise never breaks the layout."""
    if piece == "":
        return "∅"
    return "".join({"\n": "↵", "\t": "→", "\r": "␍"}.get(ch, "·" if ord(ch) < 32 or ord(ch) == 127 else ch)
                   for ch in piece)


class Pieces:
    """Token id -> display string, from a tokenizer (live) or a trace's `token_strings` (replay)."""

    def __init__(self, fetch: Callable[[list[int]], list[str]] | None = None, table: dict[int, str] | None = None):
        self.fetch = fetch
        self.table: dict[int, str] = dict(table or {})

    @classmethod
    def from_trace(cls, done: dict) -> "Pieces":
        return cls(table={int(k): v for k, v in (done.get("token_strings") or {}).items()})

    def learn(self, ids: Iterable[int]) -> None:
        missing = sorted({i for i in ids if i not in self.table})
        if missing and self.fetch is not None:
            self.table.update(zip(missing, self.fetch(missing)))

    def __getitem__(self, i: int) -> str:
        return self.table.get(i, f"⟨{i}⟩")  # a trace written without a tokenizer still replays, as ids

    def text(self, ids: Iterable[int]) -> str:
        return "".join(self[i] for i in ids)


@dataclass(frozen=True)
class Frame:
    """What the screen shows at one moment: a block's canvas after a step (step 0: the starting noise)."""

    block: int  # 0-based
    num_blocks: int
    step: int  # 0 = the block's starting canvas, else 1-based step
    max_steps: int
    ids: tuple[int, ...]  # the current best token per position (step 0: the starting canvas)
    kinds: tuple[int, ...]  # per position: RENOISED or accepted level 0..3
    changed: tuple[bool, ...]  # per position: best token differs from the previous frame's
    elapsed_s: float  # model time so far (sum of recorded step times): the same live and in replay
    temperature: float | None = None
    accepted: int | None = None
    mean_entropy: float | None = None
    stop_reason: str | None = None


@dataclass(frozen=True)
class Committed:
    """A finished block: its answer ids (cut at the stop id) and the frame it ended on."""

    block: int
    ids: tuple[int, ...]
    last: Frame


def block_label(f: Frame) -> str:
    """"block 1 of at most 4": the block count is a cap (the answer may stop at an earlier block), so it is
    never written as a fraction that promises the rest."""
    return f"block {f.block + 1} of at most {f.num_blocks}"


def status_line(f: Frame) -> str:
    parts = [block_label(f), f"step {f.step}/{f.max_steps}"]
    if f.step == 0:
        parts.append("noise")
    else:
        parts += [f"T {f.temperature:.3f}", f"accepted {f.accepted}/{len(f.ids)}", f"mean H {f.mean_entropy:.4f}"]
    parts.append(f"elapsed {f.elapsed_s:.2f}s")
    if f.stop_reason:
        parts.append("stopped: " + STOP_LABELS.get(f.stop_reason, f.stop_reason))
    return " · ".join(parts)


class Shows(Protocol):
    """Where a Watch sends each new frame (dgcli.render.watch.Display), Rich kept out of here."""

    def show(self, item: Frame | Committed) -> None: ...


@dataclass
class Watch:
    """Feed it one run's records (block_start, step, commit, done) in order: it folds them into Frames and
    Committed blocks, keeps every one and shows each on `display`."""

    pieces: Pieces
    max_steps: int
    display: Shows | None = None
    frames: list[Frame] = field(default_factory=list)
    commits: list[Committed] = field(default_factory=list)
    prev: list[int] = field(default_factory=list)  # the last frame's ids
    elapsed: float = 0.0
    num_blocks: int = 1

    def feed(self, rec: dict) -> None:
        self.pieces.learn(rec.get("argmax") or rec.get("canvas") or rec.get("tokens") or [])
        item = self._fold(rec)
        if item is not None and self.display is not None:
            self.display.show(item)

    def _fold(self, rec: dict) -> Frame | Committed | None:
        kind = rec["type"]
        if kind == "block_start":
            self.num_blocks, self.prev = rec["num_blocks"], list(rec["canvas"])
            c = len(self.prev)
            self.frames.append(Frame(rec["block"], self.num_blocks, 0, self.max_steps, tuple(self.prev),
                                     (RENOISED,) * c, (False,) * c, self.elapsed))
            return self.frames[-1]
        if kind == "step":
            ids = rec["argmax"]
            self.elapsed += rec["elapsed_s"]
            self.max_steps = rec["max_steps"]
            self.frames.append(Frame(
                rec["block"], self.num_blocks, rec["step"], rec["max_steps"], tuple(ids),
                tuple(kind_of(a, h) for a, h in zip(rec["accepted"], rec["entropy"])),
                tuple(a != b for a, b in zip(ids, self.prev)), self.elapsed, rec["temperature"],
                rec["accepted_count"], rec["mean_entropy"], rec["stop_reason"]))
            self.prev = list(ids)
            return self.frames[-1]
        if kind == "commit":
            tokens = rec["tokens"] if rec["stop_index"] is None else rec["tokens"][: rec["stop_index"]]
            self.commits.append(Committed(rec["block"], tuple(tokens), self.frames[-1]))
            return self.commits[-1]
        return None  # done: nothing new to show

    def final_text(self) -> str:
        """The run's text from the display pieces (a replay has no tokenizer to decode with)."""
        return "".join(self.pieces.text(c.ids) for c in self.commits)
