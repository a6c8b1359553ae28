"""Rows of different lengths in one batch (dgcli/model/gemma.py with per-row cache lengths): each row's
logits equal its solo run, and transformers' left-padded batch (attention_mask), on random configs whose
prompts are longer than the sliding window; then a commit of a block at each row's own position."""

import pytest
import torch
from passes import Seqs, decode, encode
from hf_oracle import CONFIGS, build_reference

import dgcli

FP32_TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS)[:2])
def pair(request, tmp_path_factory):
    ref = build_reference(request.param, seed=11)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, dgcli.load_model(path)


def ragged(cfg, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    canvas = torch.randint(0, cfg.vocab_size, (len(lengths), cfg.canvas_length), generator=g)
    return prompts, canvas


def batched_logits(model, prompts, canvas, blocks=()):
    """Our ragged batch: right-padded ids with per-row lengths, then committed blocks, then one canvas pass."""
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    cache = Seqs(model, len(prompts), n + len(blocks) * model.config.canvas_length)
    encode(model, ids, cache, [len(p) for p in prompts])
    for block in blocks:
        encode(model, block, cache)
    assert cache.lens == [len(p) + len(blocks) * model.config.canvas_length for p in prompts]
    return model.logits(decode(model, canvas, cache))


def test_rows_of_different_lengths_equal_their_solo_runs_and_the_reference(pair):
    ref, ours = pair
    cfg = ours.config
    w = cfg.sliding_window
    lengths = [2 * w + 3, 3, w + 1]  # longer than the window, shorter than it, at its edge
    prompts, canvas = ragged(cfg, lengths)
    got = batched_logits(ours, prompts, canvas)  # [B, C, V]
    for b, p in enumerate(prompts):
        solo = ours.forward_canvas(p[None], canvas[b:b + 1])[0]
        assert (got[b] - solo).abs().max() <= FP32_TOL, b
    # transformers: left padding with an attention mask (its positions shift with the padding; RoPE only
    # sees differences, so the logits agree to fp32 rounding)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, n - len(p):], mask[b, n - len(p):] = p, 1
    with torch.no_grad():
        dmask = torch.cat((mask, torch.ones_like(canvas)), dim=1)  # as generate builds it
        want = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=canvas, decoder_attention_mask=dmask).logits
    assert (got - want).abs().max() <= FP32_TOL


def test_committed_blocks_continue_at_each_rows_own_position(pair):
    _, ours = pair
    cfg = ours.config
    prompts, canvas = ragged(cfg, [cfg.sliding_window + 4, 2], seed=1)
    block = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=torch.Generator().manual_seed(2))
    got = batched_logits(ours, prompts, canvas, blocks=[block])
    for b, p in enumerate(prompts):
        cache = Seqs(ours, 1, len(p) + cfg.canvas_length)
        encode(ours, p[None], cache)
        encode(ours, block[b:b + 1], cache)
        solo = ours.logits(decode(ours, canvas[b:b + 1], cache))[0]
        assert (got[b] - solo).abs().max() <= FP32_TOL, b
    # the rows really differ in length: a shared-position batch would give other numbers
    assert (got[1] - ours.forward_canvas(torch.cat((prompts[1], block[1]))[None], canvas[1:2])[0]).abs().max() <= 1e-4
