"""Random-weight DiffusionGemma models and checkpoints in the released layout (spec §3), for tests, benchmarks and
`--dummy`: plain, FP8 (compressed-tensors' FP8-dynamic layout), NVFP4, GGML blocks kept quantized (`--weights q4_k /
q8_0`) or a GGUF file; the `--dummy` config (a config.json, or the shipped 26B-A4B one, optionally cut to N layers).
Must not: run the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dgcli.checkpoint import compressed_tensors as ct
from dgcli.checkpoint import ggml_quants
from dgcli.checkpoint.config import RELEASED_ROPE_PARAMETERS, parse_config, read_json, real_config_path
from dgcli.checkpoint.directory import to_checkpoint_name
from dgcli.checkpoint.meta import meta_model
from dgcli.errors import UserError
from dgcli.model import fp8, ggml, nvfp4
from dgcli.model.gemma import DiffusionGemma

REFERENCE_GENERATION_CONFIG = {
    "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_max": 0.8, "t_min": 0.4, "stability_threshold": 1, "confidence_threshold": 0.005,
    "max_new_tokens": 256, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
}


def reference_generation_config(canvas_length: int) -> dict:
    """The released generation_config.json with its budget kept at one canvas, as released (256 new
    tokens on the 256-token canvas): so a random checkpoint of an 8- or 16-token canvas generates one
    block by default too, not 256 / 8 = 32 of them."""
    return {**REFERENCE_GENERATION_CONFIG, "max_new_tokens": int(canvas_length)}


TINY_VISION = {  # a tiny vision_config, so transformers does not build a full-size tower
    "model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 8,
}


def make_config(text_config: dict, canvas_length: int = 256, dtype: str = "bfloat16") -> dict:
    """A full config.json dict around a text_config (top-level keys as the released checkpoint has them;
    `rope_parameters` per layer type as released unless `text_config` gives its own)."""
    rope = {kind: dict(params) for kind, params in RELEASED_ROPE_PARAMETERS.items()}
    text = {"model_type": "diffusion_gemma_text", "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0, "pad_token_id": 0, "bos_token_id": 2,
            "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False,
            "rope_parameters": rope, **text_config}
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "canvas_length": canvas_length, "text_config": text, "vision_config": dict(TINY_VISION),
            "eos_token_id": [1, 106], "tie_word_embeddings": True, "dtype": dtype}


@torch.no_grad()
def randomize_(model: DiffusionGemma, seed: int = 0, std: float | None = None) -> DiffusionGemma:
    """Give every parameter and buffer a random value, drawn on its own device in its own dtype (a 26B dummy never
    exists in fp32 on the host): matrices ~ N(0, std), std = 1/sqrt(fan_in) unless given; gains and scales
    ~ U(0.5, 1.5). FP8 matrices are drawn so in fp32 (one expert's at a time) and quantized."""
    gens: dict[torch.device, torch.Generator] = {}

    def gen(device: torch.device) -> torch.Generator:
        return gens.setdefault(device, torch.Generator(device=device).manual_seed(seed))

    quantized = fp8.quantized_names(model) | ggml.quantized_names(model) | nvfp4.quantized_names(model)  # drawn below
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name in quantized:
            continue
        if t.ndim >= 2:
            t.normal_(0.0, std if std is not None else 1.0 / math.sqrt(t.shape[-1]), generator=gen(t.device))
        else:
            t.uniform_(0.5, 1.5, generator=gen(t.device))
    for m in model.modules():
        pairs = ([(m.weight, m.weight_scale)] if isinstance(m, fp8.FP8Linear) else
                 [(m.gate_up_proj, m.gate_up_proj_scale), (m.down_proj, m.down_proj_scale)]
                 if isinstance(m, fp8.FP8Experts) else [])
        for q, s in pairs:
            for qe, se in zip(q.view(-1, *q.shape[-2:]), s.view(-1, *s.shape[-2:])):
                w = torch.empty(qe.shape, device=qe.device).normal_(0.0, std or 1 / math.sqrt(qe.shape[-1]),
                                                                    generator=gen(qe.device))
                qq, ss = fp8.quantize_rows(w)
                qe.copy_(qq)
                se.copy_(ss)
    for m in model.modules():  # NVFP4: random codes (RMS 2.93 over the 16), one e4m3 scale giving std 1/sqrt(fan_in)
        for b in [n for n, t in m.named_buffers(recurse=False) if t.dtype == torch.uint8] if isinstance(
                m, nvfp4.KINDS) else ():
            q = m.get_buffer(b)
            q.random_(0, 256, generator=gen(q.device))
            leaf = "weight" if b == "weight_packed" else b
            m.get_buffer(leaf + "_scale").fill_((std or 1 / math.sqrt(2 * q.shape[-1])) / 2.93)
            m.get_buffer(leaf + "_global").fill_(1.0)
    return model


def random_model(cfg_dict: dict, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> DiffusionGemma:
    """A randomly initialised model of a config, allocated once on `device`, every tensor in `dtype` (the layer
    scalars too: the model equals its own checkpoint loaded back in that dtype). A config with a quantization_config
    (`with_fp8`) gets FP8 (or NVFP4) linears and experts, drawn without an unquantized copy."""
    cfg = parse_config(cfg_dict)
    model = meta_model(cfg)
    model.to(dtype)
    if cfg.quantization is not None and cfg.quantization.nvfp4:
        fp8.convert_(model, *fp8.targets(model), True, nvfp4.KINDS)
    elif cfg.quantization is not None:
        fp8.convert_(model, *fp8.targets(model), dtype)
    model.to_empty(device=device)
    return randomize_(model, seed).eval()


def with_fp8(cfg_dict: dict, nvfp4: bool = False) -> dict:
    """The config with the quantization_config of an FP8-dynamic (or NVFP4A16) checkpoint (compressed-tensors')."""
    n = int(cfg_dict["text_config"]["num_hidden_layers"])
    return dict(cfg_dict, quantization_config=ct.quantization_config(n, nvfp4=nvfp4))


def write_checkpoint(model: DiffusionGemma, out_dir: str | Path, cfg_dict: dict, *, shards: int = 1,
                     generation_config: dict | None = None) -> Path:
    """Write a model's weights and config in the released layout (an FP8 model: the FP8-dynamic layout,
    with its quantization_config)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Layer scalars in fp32 as the released checkpoint stores them (exact: fp32 holds every bf16/fp16 value); FP8
    # experts unfused into per-expert linears, as compressed-tensors stores them.
    state = {to_checkpoint_name(k): (v.float() if k.endswith("layer_scalar") else v).detach().contiguous().cpu()
             for k, v in ct.unfused_state(model).items()}
    cfg_dict = dict(cfg_dict, dtype=str(model.embed_weight.dtype).removeprefix("torch."))
    cfg_dict.pop("quantization_config", None)
    if fp8.is_fp8(model):
        cfg_dict = with_fp8(cfg_dict)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True))
    gen = generation_config if generation_config is not None else reference_generation_config(cfg_dict["canvas_length"])
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True))
    if shards <= 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    names = sorted(state)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return out


SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Block diffusion writes a whole canvas at once, "
    "then refines it step by step until the tokens settle. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12.\n"
)


def write_random_checkpoint(out_dir: str | Path, text_config: dict, *, canvas_length: int = 256,
                            seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 1,
                            generation_config: dict | None = None, tokenizer: bool = True,
                            weights: str = "plain") -> Path:
    """A random-weight checkpoint of `text_config` (a dict of text_config keys), with a small Gemma-4-style
    tokenizer and chat template when the vocabulary can hold one; `weights="fp8"`: the model quantized to FP8."""
    from dgcli.text.build import MIN_VOCAB_SIZE, build_tokenizer, write_tokenizer_files

    if weights not in ("plain", "fp8"):
        raise ValueError(f"weights={weights!r}: plain or fp8")
    cfg_dict = make_config(text_config, canvas_length)
    model = random_model(cfg_dict, seed=seed, dtype=dtype)
    if weights == "fp8":
        fp8.quantize_model_(model)
    out = write_checkpoint(model, out_dir, cfg_dict, shards=shards, generation_config=generation_config)
    vocab = int(text_config["vocab_size"])
    if tokenizer and vocab >= MIN_VOCAB_SIZE:
        write_tokenizer_files(build_tokenizer([SAMPLE_TEXT] * 4, vocab), out)
    return out


# ---- GGML dummy weights (--dummy --weights q4_k / q8_0) ----------------------------------------------------

GGML_WEIGHTS = ("q4_k", "q8_0")


def ggml_dummy_type(weights: str, k: int) -> int | None:
    """The block type a dummy matrix with rows of k values gets, as llama.cpp's mix falls back: q4_k: Q4_K, or
    Q5_0 where k is not a multiple of 256 (this model's down projections, 704 and 2112). q8_0: Q8_0."""
    order = {"q4_k": (ggml.Q4_K, ggml.Q5_0), "q8_0": (ggml.Q8_0,)}[weights]
    return next((t for t in order if ggml.fits(t, k)), None)


def ggml_dummy_bytes(cfg_dict: dict, weights: str, dtype: torch.dtype) -> int:
    """Bytes a GGML dummy model holds (the kernels' prepared forms, the rest in dtype), from the config without
    allocating: the memory preflight's count."""
    from dgcli.kernels.ggml_cpu import prepared_bytes

    model = meta_model(parse_config(cfg_dict))
    total = sum(t.numel() for t in list(model.parameters()) + list(model.buffers())) * dtype.itemsize
    for m in map(model.get_submodule, ggml_quants.targets(model)):
        t = ggml_dummy_type(weights, m.in_features)
        if t is not None:
            total += prepared_bytes(t, m.out_features, m.in_features, dtype) - m.weight.numel() * dtype.itemsize
    c = model.config
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    tg, td = ggml_dummy_type(weights, h), ggml_dummy_type(weights, i)
    if tg is not None and td is not None:
        per_layer = prepared_bytes(tg, 2 * i, h, dtype) + prepared_bytes(td, h, i, dtype) - 3 * h * i * dtype.itemsize
        total += c.num_hidden_layers * e * per_layer
    return total


@torch.no_grad()
def random_ggml_model(cfg_dict: dict, weights: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu") -> DiffusionGemma:
    """A random model whose linears and experts are GGML modules of random valid blocks (drawn as bytes, nothing
    quantized: the 26B-A4B builds in about a minute) in `ggml_dummy_type`'s types; the embedding, router, norms and
    scalars plain tensors in dtype. CPU only (the int4 kernel is)."""
    if torch.device(device).type != "cpu":
        raise UserError(f"--weights {weights} runs on CPU (torch's int4 CPU kernel); use --device cpu")
    model = meta_model(parse_config(cfg_dict))
    model.to(dtype)
    g = torch.Generator().manual_seed(seed)
    ggml_quants.to_ggml_(model, lambda k: ggml_dummy_type(weights, k),
                         lambda w, t: ggml_quants.random_blocks(w.shape[:-1], t, w.shape[-1], g), dtype)
    for m in model.modules():  # the plain tensors left on meta
        for store in (m._parameters, m._buffers):
            for key, t in store.items():
                if t is not None and t.is_meta:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    store[key] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
    return randomize_(model, seed).eval()


# ---- --dummy: a config's architecture with random weights ----------------------------------------------

def dummy_config(spec: str, layers: int | None = None) -> tuple[dict, dict | None, str]:
    """(config.json dict, generation_config dict or None, name) for --dummy: a config.json path, a directory holding
    one, or the word 26B-A4B (the shipped config); `layers` keeps the first N layers (the last one full attention)."""
    if spec.strip().upper() in ("26B-A4B", "26B", "DIFFUSIONGEMMA-26B-A4B"):
        path = real_config_path()
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UserError(f"--dummy {spec}: no such config.json; pass a config path or the word 26B-A4B")
    raw = read_json(path)
    parse_config(raw, source=str(path))  # validate before anything else
    gen_path = path.parent / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else None
    name = path.parent.name if path.name == "config.json" else path.stem
    if layers is not None:
        raw = shrink_layers(raw, layers)
        name += f" (first {layers} layers)"
    return raw, gen, name


def shrink_layers(raw: dict, n: int) -> dict:
    text = raw["text_config"]
    total = int(text["num_hidden_layers"])
    if not 1 <= n <= total:
        raise UserError(f"--layers {n}: the config has {total} layers; pick 1..{total}")
    types = list(text.get("layer_types") or [])
    types = types[:n] if types else None
    if types:
        types[-1] = "full_attention"
    return {**raw, "text_config": {**text, "num_hidden_layers": n, "layer_types": types}}


def write_random_gguf(cfg_dict: dict, gen: dict | None, dst: str | Path, kind: str = "q4_k_m", *, seed: int = 0,
                      name: str = "random") -> int:
    """A GGUF file of `cfg_dict` with random weights (random blocks: ~1 minute per 10 GB) in `kind`'s types
    (`quantize.gguf_types`), one tensor in memory at a time: a real-size file for benchmarks. Returns its bytes."""
    from dgcli.checkpoint import gguf, gguf_model
    from dgcli.checkpoint.quantize import GGUF_KINDS, gguf_types

    cfg = parse_config(cfg_dict)
    shapes = {gguf_model.to_gguf_name(k): tuple(v.shape) for k, v in meta_model(cfg).state_dict().items()}
    shapes[gguf_model.ROPE_FREQS] = (cfg.global_head_dim // 2,)
    types, g = gguf_types(kind, shapes, cfg.num_hidden_layers), torch.Generator().manual_seed(seed)

    def data(n: str):
        if n == gguf_model.ROPE_FREQS:
            return gguf_model.rope_freqs(cfg)
        if types[n] in ggml.QUANTIZED:
            return ggml_quants.random_blocks(shapes[n][:-1], types[n], shapes[n][-1], g)
        if len(shapes[n]) == 1:  # norms and scalars: ones (a random norm weight could be ~0)
            return torch.ones(shapes[n])
        w = torch.randn(shapes[n], generator=g) * shapes[n][-1] ** -0.5
        return w.half() if types[n] == ggml.F16 else w

    tensors = [gguf.TensorOut(n, s, types[n], lambda n=n: data(n)) for n, s in shapes.items()]
    md = gguf_model.model_metadata(cfg, gen, name=name, file_type=GGUF_KINDS[kind])
    return gguf.write_gguf(dst, md, tensors)
