"""The sliding layers' KV cache as a ring of the last W-1 positions (dgcli/model/cache.py): against
transformers (its DynamicSlidingWindowLayer keeps the same W-1) on random configs whose windows are
smaller and larger than the canvas, with prompts of more than three windows, several committed blocks and
ragged batches; bit for bit against the every-position buffers it replaced (`new_cache(rings=False)`);
and a reused slot's stale ring never read (buffers poisoned with NaN), in the model and in the engine."""

from __future__ import annotations

import math

import pytest
import torch
from hf_oracle import CONFIGS, reference_from_text

import dgcli
from dgcli.model.random_weights import make_config

FP32_TOL = 1e-4
S, F = "sliding_attention", "full_attention"
_BASE = {k: v for k, v in CONFIGS["gqa2_window6"].items() if k != "canvas"}
# Window W against canvas C: C > W-1 (w6_c8), C = W-1 (w9_c8), C < W-1 (w20_c8), a ring of one position
# (w2_c4), a full layer first and C = 16 > W-1 (gqa1_full_first's shape).
RING_CONFIGS = {
    "w6_c8": dict(_BASE, canvas=8),
    "w9_c8": dict(_BASE, sliding_window=9, layer_types=[F, S, S, F], num_hidden_layers=4, canvas=8),
    "w20_c8": dict(_BASE, sliding_window=20, num_attention_heads=4, num_key_value_heads=1,
                   layer_types=[S, F, S, F], num_hidden_layers=4, canvas=8),
    "w2_c4": dict(_BASE, sliding_window=2, canvas=4),
    "w5_c16": dict(CONFIGS["gqa1_full_first"]),
}


def build_reference(name: str, seed: int):
    """hf_oracle.build_reference for the configs above."""
    tc = dict(RING_CONFIGS[name], max_position_embeddings=4096)
    canvas = tc.pop("canvas")
    return reference_from_text(tc, canvas, seed)


@pytest.fixture(scope="module", params=sorted(RING_CONFIGS))
def pair(request, tmp_path_factory):
    ref = build_reference(request.param, seed=17)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, dgcli.load_model(path), path


def draw(cfg, lengths, blocks, seed):
    """Prompts of `lengths`, `blocks` blocks of ids for every row, a canvas and self-conditioning logits."""
    g = torch.Generator().manual_seed(seed)
    b, c, v = len(lengths), cfg.canvas_length, cfg.vocab_size
    prompts = [torch.randint(0, v, (n,), generator=g) for n in lengths]
    return (prompts, [torch.randint(0, v, (b, c), generator=g) for _ in range(blocks)],
            torch.randint(0, v, (b, c), generator=g), torch.randn(b, c, v, generator=g) * 4)


def ours_stages(model, prompts, blocks, canvas, sc, cache=None):
    """Our logits after the prompt and after each committed block (right-padded ragged prompts)."""
    n, c = max(len(p) for p in prompts), model.config.canvas_length
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    cache = cache or model.new_cache(len(prompts), n + len(blocks) * c)
    lengths = [len(p) for p in prompts]
    model.encode(ids, cache, None if len(set(lengths)) == 1 else lengths)
    soft = model.soft_embedding(sc.to(model.embed_weight.dtype))
    out = [model.logits(model.decode(canvas, cache, soft))]
    for block in blocks:
        model.encode(block, cache)
        out.append(model.logits(model.decode(canvas, cache, soft)))
    assert cache.lens == [len(p) + len(blocks) * c for p in prompts]
    return out, cache


@torch.no_grad()
def reference_stages(ref, prompts, blocks, canvas, sc):
    """transformers' logits at the same stages: left-padded prompts with an attention mask, each block
    encoded into its DynamicCache in its own pass (as generate runs them); its cache at the end."""
    from transformers import DynamicCache

    n, c = max(len(p) for p in prompts), canvas.shape[1]
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, n - len(p):], mask[b, n - len(p):] = p, 1
    cache = DynamicCache(config=ref.config.get_text_config())
    ones = torch.ones(len(prompts), c, dtype=torch.long)
    ref.model.encoder(input_ids=ids, attention_mask=mask, cache=cache)
    out = []
    for k in range(len(blocks) + 1):
        if k:
            mask = torch.cat((mask, ones), dim=1)
            ref.model.encoder(input_ids=blocks[k - 1], attention_mask=mask, cache=cache)
        out.append(ref(cache=cache, decoder_input_ids=canvas, decoder_attention_mask=torch.cat((mask, ones), 1),
                       self_conditioning_logits=sc).logits)
    return out, cache


def test_sliding_layers_hold_a_ring(pair):
    _, ours, _ = pair
    for max_len in (3, 50):
        cache, full = ours.new_cache(2, max_len), ours.new_cache(2, max_len, rings=False)
        for i, g in enumerate(ours.geometry):
            keep = max_len if g.window is None else min(g.window - 1, max_len)
            assert cache.k[i].shape == cache.v[i].shape == (2, g.num_kv_heads, keep, g.head_dim)
            assert full.k[i].shape == (2, g.num_kv_heads, max_len, g.head_dim)
            assert cache.ring[i] == (None if g.window is None else keep)


@pytest.mark.parametrize("batch", [1, 2])
def test_prompt_of_three_windows_and_three_commits_match_reference(pair, batch):
    """One encoder pass over a prompt of 3W+2 tokens (its early tokens attend within their windows to
    positions the ring no longer holds at the end), then three blocks committed one by one: the canvas
    logits after each, and the K/V left in every layer (the ring's last W-1 on sliding layers, every
    position on full ones: their values carry the early tokens' sliding attention), against transformers."""
    ref, ours, _ = pair
    cfg = ours.config
    w = cfg.sliding_window
    prompts, blocks, canvas, sc = draw(cfg, [3 * w + 2] * batch, 3, seed=batch)
    got, cache = ours_stages(ours, prompts, blocks, canvas, sc)
    want, ref_cache = reference_stages(ref, prompts, blocks, canvas, sc)
    for k, (a, b) in enumerate(zip(got, want)):
        assert (a - b).abs().max() <= FP32_TOL, k
    end = cache.lens[0]
    assert all(r is None or end > 2 * r for r in cache.ring)  # every ring wrapped around at least twice
    for i, layer in enumerate(ref_cache.layers):
        n = layer.keys.shape[2]
        assert n == (end if cache.ring[i] is None else w - 1)
        k, v = cache.read(i, end - n, end)
        assert (k - layer.keys).abs().max() <= FP32_TOL and (v - layer.values).abs().max() <= FP32_TOL, i


def test_ragged_rows_with_commits_match_reference_and_their_solo_runs(pair):
    """Rows longer than three windows, shorter than one, at the ring's edge, committing two blocks each at
    its own position: transformers' left-padded batch, and each row alone."""
    ref, ours, _ = pair
    cfg = ours.config
    w = cfg.sliding_window
    lengths = [3 * w + 2, 2, max(1, w - 1), 3 * w + 5]
    prompts, blocks, canvas, sc = draw(cfg, lengths, 2, seed=7)
    got, _ = ours_stages(ours, prompts, blocks, canvas, sc)
    want, _ = reference_stages(ref, prompts, blocks, canvas, sc)
    for k, (a, b) in enumerate(zip(got, want)):
        assert (a - b).abs().max() <= FP32_TOL, k
    for r, p in enumerate(prompts):
        solo, _ = ours_stages(ours, [p], [blk[r:r + 1] for blk in blocks], canvas[r:r + 1], sc[r:r + 1])
        for k, (a, b) in enumerate(zip(got, solo)):
            assert (a[r:r + 1] - b).abs().max() <= FP32_TOL, (r, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ring_is_bit_identical_to_every_position_buffers(pair, dtype):
    """The ring is read in position order (two views where it wraps), so the attention sees the same keys
    in the same order as with the buffers it replaced: equal bit for bit, equal and ragged batches."""
    ours = dgcli.load_model(pair[2], dtype=dtype)
    cfg = ours.config
    w = cfg.sliding_window
    for lengths in ([3 * w + 2] * 2, [3 * w + 5, 2, w, 4 * w + 1]):
        prompts, blocks, canvas, sc = draw(cfg, lengths, 3, seed=len(lengths))
        n = max(lengths) + 3 * cfg.canvas_length
        got, _ = ours_stages(ours, prompts, blocks, canvas, sc)
        want, _ = ours_stages(ours, prompts, blocks, canvas, sc, ours.new_cache(len(lengths), n, rings=False))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), lengths


def poisoned(cache):
    for t in cache.k + cache.v:
        t.fill_(math.nan)
    return cache


def test_stale_ring_contents_are_never_read(pair):
    """Every buffer NaN before the first write, and a slot reused after a longer request (its ring holds
    the old request's positions): the logits equal a clean cache's, bit for bit."""
    _, ours, _ = pair
    cfg = ours.config
    w = cfg.sliding_window
    lengths = [3 * w + 2, 1, w + 3]
    prompts, blocks, canvas, sc = draw(cfg, lengths, 2, seed=3)
    n = max(lengths) + 2 * cfg.canvas_length + 4 * w
    clean, _ = ours_stages(ours, prompts, blocks, canvas, sc, ours.new_cache(3, n))
    dirty, _ = ours_stages(ours, prompts, blocks, canvas, sc, poisoned(ours.new_cache(3, n)))
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
    used = ours.new_cache(3, n)
    old, _, _, _ = draw(cfg, [4 * w + 3] * 3, 0, seed=9)
    ours.encode(torch.stack(old), used)  # a previous request filled every ring
    used.lens = [0, 0, 0]  # ... and left: the engine frees a slot by resetting its length
    again, _ = ours_stages(ours, prompts, blocks, canvas, sc, used)
    assert all(torch.equal(a, b) for a, b in zip(clean, again))


def test_reading_past_the_ring_is_an_error(pair):
    _, ours, _ = pair
    cache = ours.new_cache(1, 100)
    i = next((i for i, r in enumerate(cache.ring) if r is not None), None)
    if i is None:
        pytest.skip("no sliding layer")
    with pytest.raises(ValueError, match="ring"):
        cache.read(i, 0, cache.ring[i] + 1)


def test_engine_slots_reused_by_shorter_requests_equal_solo_runs(monkeypatch):
    """The batched engine, 2 slots for 5 requests (bf16, window 6, canvas 8): long prompts wrap the rings,
    the slots they free are taken by shorter ones; every buffer starts as NaN. Each request's events equal
    its solo run's bit for bit (the README's batch invariance)."""
    from dgcli.model.random_weights import random_model
    from dgcli.sampling.events import Done, Step
    from dgcli.sampling.loop import generate_batch_events, generate_events
    from dgcli.sampling.params import DiffusionEbParams

    tc = dict(RING_CONFIGS["w6_c8"], max_position_embeddings=4096)
    model = random_model(make_config({k: v for k, v in tc.items() if k != "canvas"}, canvas_length=8), seed=4,
                         dtype=torch.bfloat16)
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a, **kw: poisoned(new_cache(*a, **kw)))
    g = torch.Generator().manual_seed(5)
    lengths, caps = [23, 2, 17, 1, 30], [3, 2, 4, 1, 2]
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in lengths]
    params = DiffusionEbParams(max_denoising_steps=3)
    batch = list(generate_batch_events(model, prompts, params=params, num_blocks=caps, max_batch=2))
    for r, p in enumerate(prompts):
        mine = [e for e in batch if e.row == r]
        solo = list(generate_events(model, p, params=params, num_blocks=caps[r]))
        assert [type(e) for e in mine] == [type(e) for e in solo], r
        for a, b in zip(mine, solo):
            if isinstance(a, Step):
                assert torch.equal(a.sample, b.sample) and torch.equal(a.entropy, b.entropy), r
        assert isinstance(mine[-1], Done) and mine[-1].token_ids == solo[-1].token_ids, r
    assert sum(isinstance(e, Done) for e in batch) == 5
