"""Images in the prompt against transformers: its DiffusionGemmaForBlockDiffusion with a random tiny vision tower,
saved and loaded by dgemma (the tower from the checkpoint's own layout); logits with one and two images equal."""

import math

import numpy as np
import pytest
import torch
from hf_oracle import randomise_, text_config

import dgcli
from dgcli.checkpoint.random_weights import make_config
from dgcli.text.images import patchify

# Vision shapes: MHA and GQA heads, pooling 2 and 3, standardised or not.
VISION = {
    "mha_k2_std": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                       position_embedding_size=24, standardize=True),
    "gqa_k3": dict(hidden_size=24, intermediate_size=20, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=12, patch_size=2, pooling_kernel_size=3,
                   position_embedding_size=20, standardize=False),
}
# (text shape, vision shape, use_bidirectional_attention): "vision" as released; None keeps images causal.
CASES = [("gqa2_window6", "mha_k2_std", "vision"), ("gqa4_moe8", "gqa_k3", "vision"),
         ("gqa1_full_first", "gqa_k3", None)]


def reference(text: str, vision: str, bidirectional: str | None, dtype=torch.float32):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    tc, canvas = text_config(text)
    tc["use_bidirectional_attention"] = bidirectional
    v = tc["vocab_size"]
    full = make_config(tc, canvas_length=canvas)
    cfg = DiffusionGemmaConfig(text_config=full["text_config"], vision_config=dict(model_type="gemma4_vision",
                               **VISION[vision]), canvas_length=canvas, boi_token_id=v - 3, image_token_id=v - 2,
                               eoi_token_id=v - 1)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    randomise_(model, 11)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():  # the tower too (randomise_ leaves it), gains near 1 and a position table of O(1)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "vision" in name and "inv_freq" not in name:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1]) if t.ndim >= 2
                        else torch.rand(t.shape, generator=g) + 0.5)
    return model.to(dtype)


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def pair(request, tmp_path_factory):
    ref = reference(*request.param)
    path = tmp_path_factory.mktemp("vision")
    ref.save_pretrained(path)
    return ref, path, request.param[2]


def image(seed: int, h: int, w: int, vc) -> tuple[np.ndarray, np.ndarray]:
    """Random pixels already at a size the processor keeps (sides multiples of k · patch)."""
    px = np.random.default_rng(seed).random((3, h, w), dtype=np.float32)
    return patchify(px, vc.patch_size)


def prompt_with(images: list, vc, v: int, k2: int) -> list[int]:
    """text, then per image <boi> <image> x soft tokens <eoi>, then text."""
    ids, g = [2, 5, 6, 7], np.random.default_rng(3)
    for patches, _ in images:
        ids += [v - 3] + [v - 2] * (len(patches) // k2) + [v - 1] + [int(x) for x in g.integers(5, v - 4, 3)]
    return ids


def hf_inputs(images: list) -> dict:
    """pixel_values padded to the largest image's patches, positions -1 there, as the processor pads."""
    n = max(len(p) for p, _ in images)
    pv = torch.zeros(len(images), n, images[0][0].shape[1])
    pos = torch.full((len(images), n, 2), -1, dtype=torch.long)
    for i, (p, xy) in enumerate(images):
        pv[i, :len(p)], pos[i, :len(p)] = torch.from_numpy(p), torch.from_numpy(xy)
    return dict(pixel_values=pv, image_position_ids=pos)


def run_both(ref, ours, shapes: list, dtype):
    vc, v = ours.vision.config, ours.config.vocab_size
    k = vc.pooling_kernel_size * vc.patch_size
    images = [image(i, h * k, w * k, vc) for i, (h, w) in enumerate(shapes)]
    ids = torch.tensor([prompt_with(images, vc, v, vc.pooling_kernel_size ** 2)])
    canvas = torch.randint(0, v - 3, (1, ours.config.canvas_length), generator=torch.Generator().manual_seed(4))
    mm = (ids == v - 2).long()
    with torch.no_grad():
        want = ref(input_ids=ids, decoder_input_ids=canvas, mm_token_type_ids=mm, **hf_inputs(images)).logits
        # causal over the images (no mm_token_type_ids): the bidirectional spans must matter
        causal = ref(input_ids=ids, decoder_input_ids=canvas, **hf_inputs(images)).logits
    feats = torch.cat([ours.vision.features(torch.from_numpy(p), torch.from_numpy(xy)) for p, xy in images])
    got = ours.forward_canvas(ids, canvas, image_features=feats, image_id=v - 2)
    return got, want, causal


@pytest.mark.parametrize("shapes", [[(2, 3)], [(3, 2), (2, 2)]], ids=["one_image", "two_images"])
def test_logits_with_images_match_reference_fp32(pair, shapes):
    ref, path, bidirectional = pair
    ours = dgcli.load_model(path)
    assert ours.vision is not None
    got, want, causal = run_both(ref, ours, shapes, torch.float32)
    assert (got - want).abs().max() <= 1e-4
    if bidirectional:  # the image spans' mask matters, or parity proves nothing of it
        assert (want - causal).abs().max() > 1e-3


def test_logits_with_images_match_reference_bf16(pair):
    """Against transformers' own bf16 run (from_pretrained in bf16, its eager experts: tests/model/test_model_parity.py
    says why), within one bf16 step of a logit. Two images of one size: transformers pads a batch of images to the
    largest and masks the padding, which changes its bf16 attention sums (by noise these tiny random models amplify
    past 1.0); dgemma runs each image's real patches only."""
    from transformers import DiffusionGemmaForBlockDiffusion

    ref16 = DiffusionGemmaForBlockDiffusion.from_pretrained(pair[1], dtype=torch.bfloat16,
                                                            experts_implementation="eager").eval()
    ours = dgcli.load_model(pair[1], dtype="bfloat16")
    got, want, _ = run_both(ref16, ours, [(2, 3), (2, 3)], torch.bfloat16)
    assert (got - want).abs().max() <= 0.02


# ---- the engine: generate with images, token- and step-identical to transformers' generate ---------------------

def confident(ref):
    """Large logit gaps (the tied embedding scaled), so every step's argmax is far from a tie: fp32 noise cannot
    change a token, and the whole generate is comparable token for token."""
    with torch.no_grad():
        ref.model.decoder.embed_tokens.weight.mul_(4)
    return ref


@pytest.fixture(scope="module")
def sure(tmp_path_factory):
    ref = confident(reference("gqa2_window6", "mha_k2_std", "vision"))
    path = tmp_path_factory.mktemp("sure")
    ref.save_pretrained(path)
    return ref, dgcli.load_model(path)


def hf_generate(ref, ids, init, images, params, blocks):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    gc = DiffusionGemmaGenerationConfig(
        max_new_tokens=blocks * init.shape[1], max_denoising_steps=params.max_denoising_steps,
        sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": params.entropy_bound},
        t_min=params.t_min, t_max=params.t_max, stability_threshold=params.stability_threshold,
        confidence_threshold=params.confidence_threshold, eos_token_id=[1], pad_token_id=0)
    kw = dict(mm_token_type_ids=(ids == ref.config.image_token_id).long(), **hf_inputs(images)) if images else {}
    out = ref.generate(input_ids=ids, decoder_input_ids=init, generation_config=gc, **kw)
    return out.sequences[0, ids.shape[1]:].tolist(), float(out.tokens_per_forward)


@pytest.mark.parametrize("budget", [2048, 5], ids=["one_pass", "chunked"])
def test_generate_with_images_matches_reference_generate(sure, budget):
    """The engine's prompt pass (one pass, or chunks of 5 rows that must not split an image's 6 tokens), then a
    block at temperatures near 0 (one-hot draws: the two samplers' different random streams cannot matter): the
    same tokens and tokens-per-forward as transformers' generate with pixel_values; and the images change the
    answer, or this proves nothing of them. One block: a later block starts from each sampler's own noise."""
    from dgcli.engine.llm_engine import LLMEngine
    from dgcli.sampling.events import Done
    from dgcli.sampling.params import DiffusionEbParams

    ref, ours = sure
    vc, v, c = ours.vision.config, ours.config.vocab_size, ours.config.canvas_length
    k = vc.pooling_kernel_size * vc.patch_size
    images = [image(i, h * k, w * k, vc) for i, (h, w) in enumerate([(2, 3), (3, 2)])]
    ids = torch.tensor([prompt_with(images, vc, v, vc.pooling_kernel_size ** 2)])
    init = torch.randint(0, v - 3, (1, c), generator=torch.Generator().manual_seed(0))
    params = DiffusionEbParams(max_denoising_steps=6, seed=0, t_min=0.001, t_max=0.002)
    want = hf_generate(ref, ids, init, images, params, 1)
    assert want != hf_generate(ref, ids, init, [], params, 1)
    engine = LLMEngine(ours, slots=1, max_len=ids.shape[1] + c, budget=budget)
    engine.add_request(ids[0].tolist(), request_id=0, params=params, num_blocks=1, first_canvas=init[0],
                       stop_ids=[1], images=[(p, xy, i) for i, (p, xy) in enumerate(images)])
    done = [e for e in engine.events() if isinstance(e, Done)][0]
    assert done.token_ids == want[0][:len(done.token_ids)] and done.tokens_per_forward == pytest.approx(want[1])


def test_a_repeated_image_is_encoded_once_and_answers_alike(sure):
    """Prefix caching keys an image's tokens by its content: the same image again is not re-encoded and gives
    the same answer; another image of the same size is a miss."""
    from dgcli.engine.llm_engine import LLMEngine
    from dgcli.sampling.events import Done
    from dgcli.sampling.params import DiffusionEbParams

    _, ours = sure
    vc, v = ours.vision.config, ours.config.vocab_size
    k = vc.pooling_kernel_size * vc.patch_size
    one, other = image(0, 2 * k, 3 * k, vc), image(5, 2 * k, 3 * k, vc)
    ids = prompt_with([one], vc, v, vc.pooling_kernel_size ** 2) + [9] * 20
    stats: dict = {}
    engine = LLMEngine(ours, slots=1, max_len=len(ids) + 2 * ours.config.canvas_length, prefix_caching=True,
                       stats=stats, block_size=4)
    params = DiffusionEbParams(max_denoising_steps=4, seed=0)
    answers = []
    for n, (img, key) in enumerate([(one, "a"), (one, "a"), (other, "b")]):
        engine.add_request(ids, request_id=n, params=params, num_blocks=1, images=[(*img, key)])
        answers.append([e for e in engine.events() if isinstance(e, Done)][0].token_ids)
    assert stats["images_encoded"] == 2 and stats["prefix_cache_hits"] > 0
    assert answers[0] == answers[1] != answers[2]


def test_the_triton_kernel_keeps_image_spans_bidirectional(pair, triton_device, monkeypatch):
    """The paged Triton kernel (the interpreter on CPU, compiled on a GPU) reads each image row's whole span, as
    the SDPA path's mask does: the same logits as transformers."""
    from dgcli.model import attention

    ref, path, _ = pair
    ours = dgcli.load_model(path)
    with torch.inference_mode():
        _, want, _ = run_both(ref, ours, [(2, 3), (2, 2)], torch.float32)
        monkeypatch.setattr(attention, "backend", lambda device: "triton-paged")
        ours.to(triton_device)
        vc, v = ours.vision.config, ours.config.vocab_size
        k = vc.pooling_kernel_size * vc.patch_size
        images = [image(i, h * k, w * k, vc) for i, (h, w) in enumerate([(2, 3), (2, 2)])]
        ids = torch.tensor([prompt_with(images, vc, v, vc.pooling_kernel_size ** 2)], device=triton_device)
        canvas = torch.randint(0, v - 3, (1, ours.config.canvas_length), generator=torch.Generator().manual_seed(4))
        feats = torch.cat([ours.vision.features(torch.from_numpy(p).to(triton_device), torch.from_numpy(xy).to(
            triton_device)) for p, xy in images])
        got = ours.forward_canvas(ids, canvas.to(triton_device), image_features=feats, image_id=v - 2)
    assert (got.cpu() - want).abs().max() <= 1e-4


def test_an_fp8_checkpoint_keeps_the_tower_unquantized(pair, tmp_path):
    """`dgemma quantize --fp8` lists the tower in its `ignore`: it loads from the FP8 checkpoint as stored, and
    gives the source's image features."""
    import json

    from dgcli.checkpoint.quantize import quantize_checkpoint

    _, path, _ = pair
    quantize_checkpoint(path, tmp_path / "fp8")
    ignore = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "re:.*vision_tower.*" in ignore
    src, fp8 = dgcli.load_model(path), dgcli.load_model(tmp_path / "fp8")
    vc = fp8.vision.config
    p, xy = image(0, 2 * vc.pooling_kernel_size * vc.patch_size, 2 * vc.pooling_kernel_size * vc.patch_size, vc)
    want = src.vision.features(torch.from_numpy(p), torch.from_numpy(xy))
    assert torch.equal(fp8.vision.features(torch.from_numpy(p), torch.from_numpy(xy)), want)


def test_a_prefix_hit_never_ends_inside_an_image(sure):
    """Two prompts with the same image and different text after it share only the blocks before the image when a
    block boundary falls inside it: the second answer is the one a fresh engine gives."""
    from dgcli.engine.llm_engine import LLMEngine
    from dgcli.sampling.events import Done
    from dgcli.sampling.params import DiffusionEbParams

    _, ours = sure
    vc, v = ours.vision.config, ours.config.vocab_size
    k = vc.pooling_kernel_size * vc.patch_size
    img = image(0, 2 * k, 3 * k, vc)  # 6 soft tokens at positions 5..10: the block boundary 8 inside
    first = prompt_with([img], vc, v, vc.pooling_kernel_size ** 2) + [9] * 10
    second = first[:12] + [10] * 10
    params = DiffusionEbParams(max_denoising_steps=4, seed=0)

    def answers(prompts, engine):
        out = []
        for n, ids in enumerate(prompts):
            engine.add_request(ids, request_id=n, params=params, num_blocks=1, images=[(*img, "a")])
            out.append([e for e in engine.events() if isinstance(e, Done)][0].token_ids)
        return out

    stats: dict = {}
    new = lambda **kw: LLMEngine(ours, slots=1, max_len=40, block_size=8, **kw)  # noqa: E731
    shared = answers([first, second], new(prefix_caching=True, stats=stats))
    assert stats["prefix_cache_hits"] == 0 and shared[1] == answers([second], new())[0]
