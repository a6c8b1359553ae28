"""The sampler's random numbers: one counter-based stream, a pure function of (seed, purpose, block, step,
position), so a draw never depends on which kernel path runs, on batch-mates, on a slot or on the order
in which draws are made.

Owns: `uniform` (float64 in [0, 1)) and `token_ids` (ints in [0, V)) over broadcastable counters, their row forms
(`rows`, `uniform_at`, `token_ids_at`), the purposes and the hash behind them. Must not: keep state (beyond a memo
of the pure host hash of counter prefixes), read a torch.Generator, or know about models.

Why not torch.Generator: its draws depend on how many numbers were taken before (the reference, CPU tiled and
Triton vocabulary passes consume different amounts), and in a batch on the row's slot. The vocabulary passes take
one uniform per position and turn it into a categorical draw by inverse CDF, so every path makes the same draw up
to float rounding at a CDF boundary.

The hash: words folded one by one into a 32-bit state with Wellons' `lowbias32` mixer. Arithmetic is exact 32-bit
unsigned, carried in int64 tensors (products split in 16-bit halves so nothing leaves int64), so CPU and CUDA give
the same bits. Not cryptographic; it only has to look independent across neighbouring counters (tests check it).
"""

from __future__ import annotations

import functools

import torch

from dgcli.kernels.transfer import to_device

# Purposes: a block's first canvas, the categorical draw, renoise ids, --init-canvas padding, the state a
# structured canvas ends in (sampling/constrain.py).
INIT, DRAW, RENOISE, PAD, END = 1, 2, 3, 4, 5

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x·c mod 2^32 for x in [0, 2^32) held in int64: (lo + hi·2^16)·c, the hi part only mod 2^16."""
    return ((x & 0xFFFF) * c + (((x >> 16) * (c & 0xFFFF)) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons, "Hash function prospector"): a bijection on 32-bit words."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash(seed: torch.Tensor | int, *words: torch.Tensor | int,
          device: torch.device | str | None = None) -> torch.Tensor:
    """A 32-bit hash (int64 tensor) of the seed (< 2^63) and the words (each < 2^32), broadcast together."""
    # Python ints stay Python ints: the same exact arithmetic (no product leaves int64), and no host-to-device
    # copy of a constant per call (on CUDA each would wait for the stream).
    seed = _word(seed, device)
    h = _mix((seed & _M32) ^ _GOLDEN)
    for w in (seed >> 32, *words):
        h = _fold(h, w, device)
    return h if isinstance(h, torch.Tensor) else torch.tensor(h, dtype=torch.long, device=device)


def _fold(h: torch.Tensor | int, w: torch.Tensor | int, device: torch.device | str | None) -> torch.Tensor | int:
    """The state after one more word: `_hash(seed, *words, w)` is `_fold(_hash(seed, *words), w)`."""
    return _mix(((h ^ _mix(((_word(w, device) & _M32) + _GOLDEN) & _M32)) + 0x7F4A7C15) & _M32)


def _word(w: torch.Tensor | int, device: torch.device | str | None) -> torch.Tensor | int:
    return w if isinstance(w, int) else torch.as_tensor(w, dtype=torch.long, device=device)


def uniform(seed: torch.Tensor | int, purpose: int, block: torch.Tensor | int, step: torch.Tensor | int,
            position: torch.Tensor | int, device: torch.device | str | None = None) -> torch.Tensor:
    """float64 uniforms in [0, 1) with 53 random bits, shaped as the counters broadcast."""
    h = _hash(seed, purpose, block, step, position, device=device)  # the words both halves share, folded once
    return _halves(h, device)


def token_ids(seed: torch.Tensor | int, purpose: int, block: torch.Tensor | int, step: torch.Tensor | int,
              position: torch.Tensor | int, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 token ids in [0, vocab_size), uniform up to vocab_size/2^32 (multiply-shift, no modulo)."""
    _check_vocab(vocab_size)
    return (_hash(seed, purpose, block, step, position, device=device) * vocab_size) >> 32


# ---- the same draws with the per-row words hashed on the host ------------------------------------------------
# A row's seed, purpose, block and step are host ints, folded in Python with the same 32-bit arithmetic; only the
# position word is folded by tensor ops, its inner mix made once (`mixed_positions`). The engine draws this way: a
# few dozen tensor ops per draw instead of a few hundred (each a kernel launch on CUDA). Same bits as `uniform` /
# `token_ids` of the same counters.


def rows(counters: list[tuple[int, ...]], device: torch.device | str) -> torch.Tensor:
    """[n, 1] int64 hash states of host counter rows (seed, purpose, block, step), sent without waiting."""
    return to_device([_state(*c) for c in counters], torch.long, device)[:, None]


@functools.lru_cache(maxsize=4096)
def _state(seed: int, *words: int) -> int:
    """The hash state of host ints (seed, *words), each prefix memoised (a step folds only its own word)."""
    if not words:
        return _fold(_mix((seed & _M32) ^ _GOLDEN), seed >> 32, None)
    return _fold(_state(seed, *words[:-1]), words[-1], None)


def mixed_positions(position: torch.Tensor) -> torch.Tensor:
    """The position words' inner mix, made once per positions tensor (what `_fold` applies to a word)."""
    return _mix(((position.long() & _M32) + _GOLDEN) & _M32)


def uniform_at(states: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """`uniform(seed, purpose, block, step, position)` from `rows` states [n, 1] and `mixed_positions` [C]."""
    return _halves(_fold_mixed(states, mixed), states.device)


def token_ids_at(states: torch.Tensor, mixed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`token_ids(seed, purpose, block, step, position, vocab_size)` from `rows` states and `mixed_positions`."""
    _check_vocab(vocab_size)
    return (_fold_mixed(states, mixed) * vocab_size) >> 32


def _fold_mixed(h: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    return _mix(((h ^ mixed) + 0x7F4A7C15) & _M32)  # `_fold` with the word's mix given


def _halves(h: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    hi, lo = _fold(h, 0, device), _fold(h, 1, device)
    return ((hi << 21) | (lo >> 11)).double() * 2.0**-53


def _check_vocab(vocab_size: int) -> None:
    if not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab_size={vocab_size}: must be in [1, 2**31)")
