"""dgcli/model/packed.py: a model whose linear and expert weights are prepacked for oneDNN has the model's
bits, layer by layer and request by request, on random bf16 configs of several shapes (the GEMM itself:
tests/kernels/test_linear_cpu.py; a CPU session that packs: tests/sampling/test_packed_session.py)."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import CONFIGS, text_config

from dgcli.kernels import linear_cpu
from dgcli.model.gemma import Experts
from dgcli.model.packed import PackedExperts, PackedLinear, pack_for_cpu
from dgcli.checkpoint.random_weights import make_config, random_model
from dgcli.engine import LLMEngine as Engine, Request
from dgcli.sampling.events import Commit, Done, Step
from dgcli.sampling.params import DiffusionEbParams
from passes import Seqs, decode, encode

pytestmark = pytest.mark.skipif(not linear_cpu.packing_available(),
                                reason="this torch build has no oneDNN bf16 packed linear")


def record(ev):
    """An event's content (no timings)."""
    if isinstance(ev, Step):
        return (ev.block, ev.step, ev.stop_reason, ev.argmax.tolist(), ev.accepted_mask.tolist(),
                ev.next_canvas.tolist(), float(ev.mean_entropy))
    if isinstance(ev, Commit):
        return (ev.block, ev.tokens, ev.stop_index)
    if isinstance(ev, Done):
        return (ev.token_ids, ev.steps_per_block, ev.finish_reason)
    return (ev.block, ev.prefix_len, ev.canvas.tolist())


def twins(name: str, kernels: str = "auto"):
    """The same random bf16 model twice, the second packed for oneDNN as a session packs it (under
    DGEMMA_KERNELS=`kernels`: bf16 packs the same way with C kernels or without)."""
    tc, canvas = text_config(name)
    cfg = make_config(tc, canvas_length=canvas)
    plain, packed = (random_model(cfg, seed=3, dtype=torch.bfloat16) for _ in range(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DGEMMA_KERNELS", kernels)
        n = pack_for_cpu(packed)
    linears = sum(type(m) is PackedLinear for m in packed.modules())
    kinds = [type(layer.experts) for layer in packed.layers]
    assert linears and set(kinds) == {PackedExperts}
    assert n == linears + 2 * plain.config.num_experts * plain.config.num_hidden_layers
    assert not any(type(m) is Experts or type(m) is torch.nn.Linear for m in packed.modules())
    return plain, packed


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_model_has_the_models_bits(name, kernels):
    """Prefix pass (the cache it leaves), a committed block, a canvas pass with self-conditioning, logits:
    the packed model's bits are the model's, on every random config (prompts over two windows, batch 2)."""
    plain, packed = twins(name, kernels)
    cfg = plain.config
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, cfg.vocab_size, (2, cfg.sliding_window * 2 + 3), generator=g)
    block = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=g)
    soft = (torch.randn(2, cfg.canvas_length, cfg.hidden_size, generator=g) * 0.5).bfloat16()
    caches = []
    with torch.inference_mode():
        outs = []
        for m in (plain, packed):
            kv = Seqs(m, 2, prompt.shape[1] + block.shape[1])
            encode(m, prompt, kv)
            encode(m, block, kv)
            caches.append(kv)
            hidden = decode(m, canvas, kv, soft)
            outs.append((hidden, m.logits(hidden)))
    for a, b in zip(caches[0].cache.k + caches[0].cache.v, caches[1].cache.k + caches[1].cache.v):
        assert torch.equal(a, b)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_packed_model_gives_every_request_the_same_events():
    """Through the engine (ragged prompts, 2 slots, 2 blocks, self-conditioning between steps): every event
    of every request equal, entropies included, on a random bf16 model."""
    plain, packed = twins("gqa4_moe8")
    cfg = plain.config
    params = DiffusionEbParams(max_denoising_steps=6)
    got = []
    for m in (plain, packed):
        g = torch.Generator().manual_seed(5)  # the same prompts for both models
        engine = Engine(m, slots=2, max_len=160, pad_id=0)
        for rid, n in enumerate((7, 30, 19)):
            engine.submit(Request(id=rid, prompt=torch.randint(1, cfg.vocab_size, (n,), generator=g),
                                  params=params, num_blocks=2, seed=rid, stops=set()))
        events: dict[int, list] = {}
        for ev in engine.events():
            events.setdefault(ev.row, []).append(record(ev))
        got.append(events)
    assert got[0] == got[1] and sum(len(v) for v in got[0].values()) > 12


def test_nothing_is_packed_where_it_does_not_apply(monkeypatch):
    """fp32 weights with the C kernels off (MKL's GEMM), a machine where the packed GEMM's bits differ,
    DGEMMA_KERNELS=reference (torch's own ops): the model is left as loaded."""
    tc, canvas = text_config("gqa2_window6")
    cfg = make_config(tc, canvas_length=canvas)
    with monkeypatch.context() as m:
        m.setenv("DGEMMA_KERNELS", "torch")
        assert pack_for_cpu(random_model(cfg, dtype=torch.float32)) == 0
    with monkeypatch.context() as m:
        m.setattr(linear_cpu, "_agrees", lambda n, k, threads: False)
        model = random_model(cfg, dtype=torch.bfloat16)
        embed = model.embed_weight
        assert pack_for_cpu(model) == 0 and model.embed_weight is embed
    monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    model = random_model(cfg, dtype=torch.bfloat16)
    assert pack_for_cpu(model) == 0
    assert not any(isinstance(m, (PackedLinear, PackedExperts)) for m in model.modules())


def test_every_linear_input_is_contiguous():
    """Packed and plain GEMMs agree on contiguous rows; F.linear of a strided input may sum in another order
    (tests/kernels/test_linear_cpu.py). So the model must feed its linears contiguous rows, in every pass."""
    tc, canvas = text_config("gqa1_full_first")
    model = random_model(make_config(tc, canvas_length=canvas), dtype=torch.bfloat16)
    seen = []
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].is_contiguous()))
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (2, 13))
    canvas_ids = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length))
    soft = torch.randn(2, cfg.canvas_length, cfg.hidden_size).bfloat16()
    with torch.inference_mode():
        kv = Seqs(model, 2, 13)
        encode(model, prompt, kv)
        decode(model, canvas_ids, kv, soft)
    assert seen and all(seen), seen


def test_a_packed_checkpoint_lets_go_of_the_file(tmp_path):
    """Loaded tensors are views of the memory-mapped file, so one left alive keeps the whole mapping resident
    beside the packed copies. After packing, no tensor of the model is a loaded one: the mapping can go."""
    import dgcli
    from dgcli.checkpoint.random_weights import write_checkpoint

    tc, canvas = text_config("gqa2_window6")
    cfg = make_config(tc, canvas_length=canvas)
    write_checkpoint(random_model(cfg, seed=1, dtype=torch.bfloat16), tmp_path, cfg)
    model = dgcli.load_model(tmp_path)
    # held alive here, so no later allocation can reuse their addresses and make the comparison pass or fail by chance
    held = list(model.parameters()) + list(model.buffers())
    loaded = {t.untyped_storage().data_ptr() for t in held}
    embed = model.embed_weight.clone()
    assert pack_for_cpu(model) > 0
    kept = list(model.parameters()) + list(model.buffers())
    assert kept and not loaded & {t.untyped_storage().data_ptr() for t in kept}
    assert torch.equal(model.embed_weight, embed)
