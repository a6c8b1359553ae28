"""The block manager of the paged KV cache (host side): which blocks of the pools each sequence holds.

Owns: the allocation of fixed-size blocks to sequences and where a position of a sequence lives. The full layers'
group holds every position a sequence reserved (position p in its table's block p // B); the sliding layers' group
a ring of `ring_blocks` blocks, the last W-1 positions rounded up to blocks (block (p // B) mod ring_blocks): a
sliding layer keeps only what a later query reads from the cache (a pass's own keys come from the pass). The
allocator hands out runs of consecutive blocks when it can: such a run is one strided view of a pool (what CPU
attention reads without a copy). Sizes are fixed when the cache is made: nothing is allocated per pass. A
released block's stale contents are never read (a reader asks only for positions its sequence wrote).
Prefix caching: a whole block written causally (prompt, committed block) gets a key chained over its parent's and
its B ids (`register`); a later sequence whose ids start the same holds those blocks too (`lookup`,
`reserve(shared=)`), counted per block; a keyed block no sequence holds stays cached until a reservation needs
room (least recently released first), and is never written again. The sliding layers then address blocks as the
full layers do (no ring) in a pool of their own, holding only the blocks a window still reads (`hold` as passes
write, `trim` below a window's start); a hit needs both groups' blocks (`lookup` shortens it to where both are
cached), as vLLM's sliding-window prefix caching does.
Must not: hold device tensors (the pools are `kv_cache.py`'s), know about attention masks, phases or the model.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def pool_blocks(windows: list[int | None], *, seqs: int, max_len: int, block_size: int, prefix_caching: bool,
                pass_rows: int | None = None) -> tuple[int, int]:
    """(full, sliding) blocks of a cache's two pools (measure/cost/memory.py restates it without torch). With
    prefix caching the sliding pool holds every sequence's window after a trim, the blocks either end of it
    straddles and one more, and one pass's causal rows (`pass_rows`; None: unbounded)."""
    full = blocks_for(max_len, block_size)
    w = max((x for x in windows if x is not None), default=None)
    if w is None:
        return seqs * full, 0
    ring = blocks_for(min(w - 1, max_len), block_size)
    if not prefix_caching:
        return seqs * full, seqs * ring
    if pass_rows is None:
        return seqs * full, seqs * full
    return seqs * full, min(seqs * full, seqs * (ring + 3) + blocks_for(pass_rows, block_size))


class BlockPool:
    """Free block ids of one group; `take(n)` prefers one run of consecutive ids (first fit). A block counts the
    sequences that hold it (`refs`) and may carry a prefix key: a keyed block no sequence holds stays cached until
    `take` runs out of plain free blocks and evicts the least recently released one."""

    def __init__(self, n: int):
        self.n, self.free = n, list(range(n))
        self.refs = [0] * n
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (parent's serial, its ids)
        self.serial: dict[int, int] = {}  # block -> its registration's serial (never reused: a chain's link)
        self.by_key: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block
        self.lru: OrderedDict[int, None] = OrderedDict()  # keyed blocks no sequence holds, oldest release first
        self.serials = itertools.count(1)  # 0: the chain's root

    @property
    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def take(self, n: int) -> list[int] | None:
        if n > self.available:
            return None
        if n > len(self.free):
            self.evict(n - len(self.free))
        free = self.free  # the first run of n consecutive ids, else the n lowest
        a = next((i for i in range(len(free) - n + 1) if free[i + n - 1] - free[i] == n - 1), 0) if n else 0
        got = free[a:a + n]
        del free[a:a + n]
        for b in got:
            self.refs[b] = 1
        return got

    def give(self, ids: list[int]) -> None:
        """Drop one reference to each of `ids` (a sequence's table, released tail first: a chain's later blocks
        are evicted before the blocks they hang on); unheld blocks go back, cached if keyed."""
        plain = []
        for b in reversed(ids):
            self.refs[b] = max(0, self.refs[b] - 1)  # (a test's own `take` keeps no counts)
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.lru[b] = None
                else:
                    plain.append(b)
        self.free = sorted(self.free + plain)

    def share(self, ids: list[int]) -> None:
        """One more reference to each cached block of `ids` (a prefix hit): out of the LRU while held."""
        for b in ids:
            self.refs[b] += 1
            self.lru.pop(b, None)

    def evict(self, n: int | None = None) -> None:
        """The `n` (None: all) least recently released cached blocks lose their keys: plain free blocks."""
        for _ in range(len(self.lru) if n is None else n):
            b, _ = self.lru.popitem(last=False)
            del self.by_key[self.key_of.pop(b)]
            self.serial.pop(b, None)  # (the sliding pool's keys have no serials: they are the full pool's)
            self.free.append(b)
        self.free.sort()


class BlockManager:
    def __init__(self, windows: list[int | None], *, seqs: int, max_len: int, block_size: int = 16,
                 prefix_caching: bool = False, pass_rows: int | None = None):
        """windows: per layer its sliding window W or None (a full layer); room for `seqs` sequences of up to
        `max_len` positions each; `pass_rows`: the most causal rows a pass writes (`pool_blocks`)."""
        self.block_size, self.max_len, self.seqs = block_size, max_len, seqs
        self.prefix_caching = prefix_caching
        self.windows = list(windows)
        self.window = max((w for w in self.windows if w is not None), default=None)
        self.full_blocks = blocks_for(max_len, block_size)  # per sequence
        self.windowed = prefix_caching and self.window is not None  # sliding blocks taken and trimmed per pass
        self.ring_blocks = (self.full_blocks if self.windowed  # (as long as a sequence: a ring never wraps)
                            else blocks_for(min(self.window - 1, max_len), block_size) if self.window else 0)
        n_full, n_ring = pool_blocks(self.windows, seqs=seqs, max_len=max_len, block_size=block_size,
                                     prefix_caching=prefix_caching, pass_rows=pass_rows)
        self.groups = {"full": BlockPool(n_full), "ring": BlockPool(n_ring)}
        self.kind = ["full" if w is None else "ring" for w in self.windows]
        self.tables: dict[int, dict[str, list[int]]] = {}  # sequence id -> group -> block ids (-1: not held)
        self.chains: dict[int, tuple[int, int]] = {}  # prefix caching: sequence -> (blocks keyed, last serial)
        self.low: dict[int, int] = {}  # windowed: sequence -> its first sliding block that may still be held

    # ---- allocation ---------------------------------------------------------------------------------------

    def reserve(self, seq: int, positions: int, shared: list[int] | None = None) -> bool:
        """Blocks for sequence `seq`'s positions 0..positions-1 (and its ring); False when the pool is short.
        `shared` (prefix caching): cached blocks from `lookup` that hold its first positions, held, not copied."""
        if positions > self.max_len:
            raise ValueError(f"{positions} positions > the cache's {self.max_len} per sequence")
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already holds blocks: release it first")
        if self.prefix_caching:
            return self._reserve_shared(seq, positions, shared or [])
        got: dict[str, list[int]] = {}
        for g in sorted(set(self.kind)):
            ids = self.groups[g].take(blocks_for(positions, self.block_size) if g == "full" else self.ring_blocks)
            if ids is None:  # give back what this call took: all or nothing
                for g2, taken in got.items():
                    self.groups[g2].give(taken)
                return False
            got[g] = ids
        self.tables[seq] = got
        return True

    def _reserve_shared(self, seq: int, positions: int, shared: list[int]) -> bool:
        pool = self.groups["full"]
        pool.share(shared)  # held first: taking the rest must not evict them
        new = pool.take(blocks_for(positions, self.block_size) - len(shared))
        if new is None:
            pool.give(shared)  # back to the LRU
            return False
        ids = shared + new
        self.tables[seq] = {"full": ids}
        if self.windowed:  # the sliding layers hold the hit's last W-1 positions now, the rest as passes write
            ring, lo = self.groups["ring"], self._window_start(len(shared))
            twins = [ring.by_key[pool.key_of[b]] for b in shared[lo:]]
            ring.share(twins)
            self.tables[seq]["ring"] = [-1] * lo + twins + [-1] * len(new)
            self.low[seq] = lo
        last = pool.serial[shared[-1]] if shared else 0
        self.chains[seq] = (len(shared), last)
        return True

    def release(self, seq: int) -> None:
        tables = self.tables.pop(seq, {})
        self.chains.pop(seq, None)
        self.low.pop(seq, None)
        for g, ids in tables.items():
            self.groups[g].give([b for b in ids if b >= 0])

    def hold(self, seq: int, lo: int, hi: int) -> None:
        """Windowed (prefix caching): sliding blocks for sequence `seq`'s positions lo..hi-1, before the pass that
        writes them (a no-op otherwise: a ring holds them). Never short: the pool is sized for it (`pool_blocks`)."""
        if not self.windowed:
            return
        table, b = self.tables[seq]["ring"], self.block_size
        need = [j for j in range(lo // b, blocks_for(hi, b)) if table[j] < 0]
        got = self.groups["ring"].take(len(need)) if need else []
        if got is None:
            raise RuntimeError(f"the sliding layers' pool is short of {len(need)} blocks: more rows in a pass "
                               "than the cache was sized for (pass_rows)")
        for j, blk in zip(need, got):
            table[j] = blk

    def trim(self, seq: int, start: int) -> None:
        """Windowed: sequence `seq`'s later passes start at position `start` or after, so its sliding blocks
        wholly before start - (W-1) are never read again: given back (cached if keyed). A no-op otherwise."""
        if not self.windowed or seq not in self.low:
            return
        table, lo = self.tables[seq]["ring"], self.low[seq]
        end = max(lo, (start - self.window + 1) // self.block_size)
        gone = [blk for blk in table[lo:end] if blk >= 0]
        table[lo:end] = [-1] * (end - lo)
        self.low[seq] = end
        if gone:
            self.groups["ring"].give(gone)

    def _window_start(self, blocks: int) -> int:
        """The first block a sequence's window reads after `blocks` whole blocks of prefix."""
        return max(0, (blocks * self.block_size - self.window + 1) // self.block_size)

    def free_blocks(self) -> dict[str, int]:
        """Blocks a reservation can take per group (with prefix caching: free and cached unheld ones)."""
        return {g: p.available for g, p in self.groups.items()}

    def drop_cached(self) -> None:
        """Forget every cached block no sequence holds: later lookups start cold, as in a new cache."""
        for pool in self.groups.values():
            pool.evict()

    def cached_blocks(self) -> int:
        """Blocks that carry a prefix key (held or not): what a later request can hit."""
        return len(self.groups["full"].key_of)

    # ---- prefix caching ---------------------------------------------------------------------------------------

    def lookup(self, ids: list[int]) -> list[int]:
        """The cached blocks that hold the longest run of whole blocks of `ids` from position 0 (a block is found
        by its key: the previous block's serial and its own B ids, compared exactly). Changes nothing."""
        pool, b = self.groups["full"], self.block_size
        got, parent = [], 0
        for j in range(len(ids) // b):
            blk = pool.by_key.get((parent, tuple(ids[j * b:(j + 1) * b])))
            if blk is None:
                break
            got.append(blk)
            parent = pool.serial[blk]
        if self.windowed and got:  # the sliding layers' blocks of the hit's last W-1 positions must be cached too
            twins = self.groups["ring"].by_key
            run = [0]  # run[h]: cached sliding twins in a row ending at block h - 1
            for blk in got:
                run.append(run[-1] + 1 if pool.key_of[blk] in twins else 0)
            h = len(got)
            while h and run[h] < h - self._window_start(h):
                h -= 1
            got = got[:h]
        return got

    def register(self, seq: int, ids: list[int]) -> None:
        """Sequence `seq`'s positions 0..len(ids)-1 hold the keys of `ids`, written by passes already launched:
        its whole blocks among them get keys (a block whose key another block has stays plain, and the chain
        goes on from that one)."""
        pool, ring, b = self.groups["full"], self.groups["ring"], self.block_size
        done, parent = self.chains[seq]
        table = self.tables[seq]["full"]
        for j in range(done, len(ids) // b):
            key = (parent, tuple(ids[j * b:(j + 1) * b]))
            blk = pool.by_key.get(key)
            if blk is None:
                blk = table[j]
                pool.key_of[blk], pool.by_key[key], pool.serial[blk] = key, blk, next(pool.serials)
            twin = self.tables[seq]["ring"][j] if self.windowed else -1
            if twin >= 0 and key not in ring.by_key:  # its sliding layers' block, by the same key
                ring.key_of[twin], ring.by_key[key] = key, twin
            parent, done = pool.serial[blk], j + 1
        self.chains[seq] = (done, parent)

    # ---- where positions live --------------------------------------------------------------------------------

    def slots(self, group: str, seq: int, lo: int, hi: int) -> torch.Tensor:
        """Physical slots (host int64 [hi - lo]) of sequence `seq`'s positions lo..hi-1 in `group`'s pools."""
        b = self.block_size
        held = self.tables[seq][group]
        if self.windowed and hi > lo and min(held[lo // b:blocks_for(hi, b)]) < 0:
            raise RuntimeError(f"sequence {seq}'s sliding blocks for positions {lo}..{hi - 1} are not held (hold)")
        table = torch.tensor(held, dtype=torch.long)
        pos = torch.arange(lo, hi)
        blk = pos // b if group == "full" else (pos // b) % self.ring_blocks
        return table[blk] * b + pos % b

    def runs(self, group: str, seq: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The slots of positions lo..hi-1 as maximal runs of consecutive slots [(start, end), ...] in position
        order (one run when the sequence's blocks are consecutive and, on a ring, the range does not wrap)."""
        b, table = self.block_size, self.tables[seq][group]
        out: list[tuple[int, int]] = []
        p = lo
        while p < hi:
            blk = p // b if group == "full" else (p // b) % self.ring_blocks
            a = table[blk] * b + p % b
            n = min(hi, (p // b + 1) * b) - p
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], a + n)
            else:
                out.append((a, a + n))
            p += n
        return out
