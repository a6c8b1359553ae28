"""NVFP4 checkpoints kept at 4 bits: files written by compressed-tensors' own compressor (not by dgemma), the same
tensors under ModelOpt's names, and GGUF type-40 blocks decode to the writers' libraries' values bit for bit; the
model in NVFP4 gives the logits of the bf16 model holding those values; bad files are one line naming the tensor."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_loader import expect, logits  # one error line naming the problem; logits of a fixed input

import dgcli
from dgcli.checkpoint.directory import to_module_name
from dgcli.kernels import nvfp4 as k
from dgcli.model import fp8, nvfp4

BUNDLED = dgcli.__path__[0] + "/data/tiny"
EXPERT = "experts.gate_up_proj"


def _ct():
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    return NVFP4PackedCompressor, preset_name_to_scheme, calculate_qparams, generate_gparam


def ct_compress(w: torch.Tensor, scheme_name="NVFP4A16", pow2=False):
    """compressed-tensors' NVFP4 of one matrix, as llm-compressor makes it: (its compressed tensors, its
    `decompress`ed weight). `pow2`: the global scale rounded to a power of two (then 1/global is exact)."""
    comp, preset, qparams, gparam = _ct()
    scheme = preset(scheme_name, ["Linear"])
    g = gparam(w.amin(), w.amax())
    if pow2:
        g = torch.tensor([2.0 ** round(math.log2(g.item()))])
    grp = w.float().unflatten(-1, (-1, 16))
    s, _ = qparams(grp.amin(-1), grp.amax(-1), scheme.weights, global_scale=g)
    c = comp.compress({"weight": w, "weight_scale": s, "weight_global_scale": g}, scheme)
    if scheme_name == "NVFP4":
        c["input_global_scale"] = torch.tensor([3.0])
    return c, comp.decompress(dict(c), scheme)["weight"]


def write_nvfp4(src, dst, layout="compressed-tensors", scheme="NVFP4A16"):
    """`src` (a bf16 checkpoint) with its attention, MLP and expert matrices quantized by compressed-tensors, in
    `layout`; returns {module name: the decompressed bf16 weight}. ModelOpt's file: the same codes and scales
    with weight_scale_2 = 1 / global (exact: the global a power of two); experts only, as NVIDIA ships it."""
    shutil.copytree(src, dst)
    state, out, ref = load_file(src / "model.safetensors"), {}, {}
    for key, t in state.items():
        name = to_module_name(key) or ""
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            parts = {"gate": t[:, :t.shape[1] // 2], "up": t[:, t.shape[1] // 2:]} if "gate_up" in name else {"down": t}
            mats = {f"{key.rsplit('.', 1)[0]}.{e}.{p}_proj": w[e] for p, w in parts.items() for e in range(len(w))}
        elif layout == "compressed-tensors" and name.endswith(".weight") and fp8.QUANTIZED.match(name[:-7]):
            mats = {key[:-7]: t}
        else:
            out[key] = t
            continue
        for prefix, w in mats.items():
            c, ref[to_module_name(prefix)] = ct_compress(w.bfloat16().contiguous(), scheme, pow2=layout != "compressed-tensors")
            if layout == "modelopt":
                c = {"weight": c["weight_packed"], "weight_scale": c["weight_scale"],
                     "weight_scale_2": 1 / c["weight_global_scale"][0], "input_scale": torch.tensor(1.0)}
            out.update({f"{prefix}.{leaf}": v.contiguous() for leaf, v in c.items()})
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if layout == "modelopt":
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    else:
        fmt = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
               "dynamic": False}
        act = dict(fmt, dynamic="local") if scheme == "NVFP4" else None
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                      "quantization_status": "compressed", "ignore": ["lm_head"], "config_groups": {
                                          "group_0": {"targets": ["Linear"], "weights": fmt, "input_activations": act,
                                                      "format": "nvfp4-pack-quantized"}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return ref


def held_weight(model, name):
    """A loaded module's weight as its held NVFP4 form decodes it (bf16)."""
    parts = name.split(".")
    if parts[2] == "experts":  # layers.L.experts.E.{gate,up,down}_proj
        mod, e, part = model.get_submodule(".".join(parts[:3])), int(parts[3]), parts[4][:-5]
        fused = "down_proj" if part == "down" else "gate_up_proj"
        w = k.decode(*(getattr(mod, fused + s)[e] for s in ("", "_scale", "_global")), mod.divide)
        return w if part == "down" else w.chunk(2)[part == "up"]
    mod = model.get_submodule(name)
    return k.decode(mod.weight_packed, mod.weight_scale, mod.weight_global, mod.divide)


@pytest.fixture(scope="module")
def bundled_nvfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    return {layout: (root / layout, write_nvfp4(Path(BUNDLED), root / layout, layout))
            for layout in ("compressed-tensors", "modelopt")}


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_loaded_weights_equal_compressed_tensors_decompress(bundled_nvfp4, layout):
    path, ref = bundled_nvfp4[layout]
    model = dgcli.load_model(path)
    assert nvfp4.is_nvfp4(model)
    assert {b.dtype for n, b in model.named_buffers() if n in nvfp4.quantized_names(model)} == {
        torch.uint8, torch.float8_e4m3fn, torch.float32}  # 4-bit codes, e4m3 scales, the globals: nothing decoded
    assert len(ref) > 50
    for name, w in ref.items():
        assert torch.equal(held_weight(model, name), w), name


@pytest.mark.parametrize("kernels", ["torch", "auto"])  # auto: the int8 product where the CPU has VNNI
def test_nvfp4_logits_match_the_dequantized_bf16_model(bundled_nvfp4, kernels, monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", kernels)
    path, ref = bundled_nvfp4["compressed-tensors"]
    model = dgcli.load_model(path, dtype="bfloat16")
    plain = dgcli.load_model(BUNDLED, dtype="bfloat16")
    state = plain.state_dict()
    for name, w in ref.items():  # the decompressed weights into the bf16 model (experts into the fused stacks)
        parts = name.split(".")
        if parts[2] == "experts":
            part, e = parts[4][:-5], int(parts[3])
            t = state[".".join(parts[:3]) + (".down_proj" if part == "down" else ".gate_up_proj")][e]
            (t if part == "down" else t.chunk(2)[part == "up"]).copy_(w)
        else:
            state[name + ".weight"].copy_(w)
    a, b = logits(model).float(), logits(plain).float()
    if kernels == "torch":
        # the same weights; the expert GEMMs are grouped differently (per expert here, grouped in the bf16 model's
        # CPU path), so a bf16 rounding step or two may differ: a logit below 32 is allowed 2 bf16 steps (measured: 0.0)
        assert (a - b).abs().max() <= 0.25
    else:  # x rounded to int8 per 16 at every NVFP4 matmul: measured 1.8e-2 relative, 0.46 at most (logits to 14)
        assert (a - b).norm() / b.norm() <= 3e-2 and (a - b).abs().max() <= 1.0


def test_w4a4_checkpoint_runs_as_w4a16(tmp_path, capsys):
    from cli_run import run

    write_nvfp4(Path(BUNDLED), tmp_path / "w4a4", scheme="NVFP4")
    code, out, err = run(["info", "--model", str(tmp_path / "w4a4"), "--format", "json"], capsys)
    assert code == 0, err
    assert "W4A16" in out and "nvfp4" in out


def test_gguf_blocks_decode_as_gguf_py():
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (6, 4 * 36), dtype=np.uint8)
    raw.reshape(6, 4, 36)[..., :4] &= 0x7F  # unsigned E4M3 scales, as llama.cpp writes them (0x7F reads as 0)
    packed, scale = k.from_gguf_blocks(torch.from_numpy(raw), 256)
    ours = k.decode(packed, scale, torch.ones(6), False, torch.float32)
    assert np.array_equal(ours.numpy(), quants.dequantize(raw, GGMLQuantizationType.NVFP4))
    assert torch.equal(k.to_gguf_blocks(packed, scale), torch.from_numpy(raw))


def _bad(src, dst, edit):
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


def test_bad_nvfp4_files_are_one_line_naming_the_tensor(bundled_nvfp4, tmp_path):
    path, _ = bundled_nvfp4["compressed-tensors"]
    q = "model.decoder.layers.0.self_attn.q_proj"
    expect(_bad(path, tmp_path / "a", lambda s: s.pop(q + ".weight_scale")), q + ".weight_scale", "lacks")
    expect(_bad(path, tmp_path / "b", lambda s: s.__setitem__(q + ".weight_global_scale", torch.tensor([float("nan")]))),
           q + ".weight_global_scale", "finite")
    expect(_bad(path, tmp_path / "c", lambda s: s.__setitem__(q + ".weight_packed", s[q + ".weight_packed"][:, :-8].clone())),
           q + ".weight_packed", "NVFP4")
    odd = _bad(path, tmp_path / "d", lambda s: None)  # the dense MLP 40 wide: down_proj's 40 inputs are no groups of 16
    cfg = json.loads((odd / "config.json").read_text())
    cfg["text_config"]["intermediate_size"], cfg["self_conditioning_size"] = 40, 320
    (odd / "config.json").write_text(json.dumps(cfg))
    expect(odd, "model.decoder.layers.0.mlp.down_proj.weight_packed", "multiple of")


def test_quantize_nvfp4_writes_what_compressed_tensors_reads(tmp_path, capsys):
    from cli_run import run
    from compressed_tensors.quantization import QuantizationScheme

    dst = tmp_path / "q"
    code, out, err = run(["quantize", BUNDLED, str(dst), "--nvfp4"], capsys)
    assert code == 0, err
    assert "NVFP4A16" in out
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    comp = _ct()[0]
    state, model = load_file(dst / "model.safetensors"), dgcli.load_model(dst)
    prefixes = {key.rsplit(".", 1)[0] for key in state if key.endswith(".weight_packed")}
    assert len(prefixes) > 50
    for prefix in prefixes:
        local = {leaf: state[f"{prefix}.{leaf}"] for leaf in ("weight_packed", "weight_scale", "weight_global_scale")}
        assert torch.equal(held_weight(model, to_module_name(prefix + ".weight")[:-7]),
                           comp.decompress(local, scheme)["weight"]), prefix
    code, out, err = run(["generate", "--model", str(dst), "--format", "json", "Sort: 7 2 9 2"], capsys)
    assert code == 0, err


def test_bench_dummy_nvfp4_rows_say_what_the_activations_are(cli_ckpt, capsys):
    from cli_run import run

    fast = ["--runs", "1", "--warmup", "0", "--num-prompts", "1", "--random-input-len", "8", "--diffusion-steps", "2",
            "--format", "jsonl", "--no-measure-peaks"]
    code, out, err = run(["bench", "--dummy", str(cli_ckpt), "--weights", "nvfp4", *fast], capsys)
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    kernels = row["provenance"]["kernels"]
    assert "nvfp4" in kernels["linear"] and kernels["experts"] == kernels["linear"]
    # int8 activations (W4A8) exactly where the CPU's C product ran: bf16 activations on a VNNI CPU
    w4a8 = row["provenance"]["dtype"] == "bfloat16" and k.available()
    assert ("W4A8" in kernels["linear"]) == w4a8
    assert row["weights"] == ("nvfp4 (W4A8)" if w4a8 else "nvfp4 (W4A16)")


def _quantized_gguf(tmp_path, capsys) -> Path:
    """`dgemma quantize --type nvfp4` of a random two-layer config (experts, dense MLPs, both attention kinds)."""
    from cli_run import run

    from dgcli.checkpoint.random_weights import write_random_checkpoint

    tc = dict(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=32,
              global_head_dim=32, num_experts=4, top_k_experts=2, sliding_window=24,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096)
    src = write_random_checkpoint(tmp_path / "src", tc, canvas_length=16, dtype=torch.bfloat16)
    dst = tmp_path / "m.gguf"
    code, out, err = run(["quantize", str(src), str(dst), "--type", "nvfp4"], capsys)
    assert code == 0, err
    assert "NVFP4" in out
    return dst


def test_gguf_nvfp4_file_loads_as_gguf_py_reads_it(tmp_path, capsys):
    from cli_run import run
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from dgcli.checkpoint.gguf_model import to_gguf_name

    dst = _quantized_gguf(tmp_path, capsys)
    model, reader = dgcli.load_model(dst), GGUFReader(dst)
    held = {n: m for n, m in model.named_modules() if isinstance(m, (nvfp4.NVFP4Linear, nvfp4.NVFP4Experts))}
    # experts, q/k/v/o and the dense MLP of the sliding layer; the full layer's without v; the self-conditioning MLP
    assert len(held) == (1 + 4 + 3) + (1 + 3 + 3) + 3
    by_name = {t.name: t for t in reader.tensors}
    n = 0
    for name, m in held.items():
        for part in (("gate_up_proj", "down_proj") if isinstance(m, nvfp4.NVFP4Experts) else ("weight",)):
            t = by_name[to_gguf_name(f"{name}.{part}" if part != "weight" else name + ".weight")]
            assert t.tensor_type == GGMLQuantizationType.NVFP4
            theirs = quants.dequantize(t.data, GGMLQuantizationType.NVFP4)
            held_part = "weight_packed" if part == "weight" else part
            ours = k.decode(getattr(m, held_part), getattr(m, f"{part}_scale"), getattr(m, f"{part}_global"), False,
                            torch.float32)
            assert np.array_equal(ours.numpy(), theirs.reshape(ours.shape)), name
            n += 1
    assert n == len(held) + 2  # experts: two matrices each
    code, out, err = run(["bench", "--model", str(dst), "--runs", "1", "--warmup", "0", "--num-prompts", "1",
                          "--random-input-len", "8", "--diffusion-steps", "2", "--format", "jsonl",
                          "--no-measure-peaks"], capsys)
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    assert row["weights"] == ("nvfp4 (W4A8)" if "W4A8" in row["provenance"]["kernels"]["linear"] else "nvfp4 (W4A16)")



def test_gguf_nvfp4_in_llama_cpps_converter_layout_runs_as_its_values(tmp_path, capsys):
    """llama.cpp's converter (conversion/base.py `_repack_nvfp4`, `_flush_nvfp4_experts`; conversion/gemma.py folds
    router.per_expert_scale into the down's scale_2) splits the experts' gate and up and writes each type-40 tensor's
    scale_2 as an F32 `<base>.scale` multiplier ([1] a matrix, [E] per expert; the down's `ffn_down_exps.scale` is
    per_expert_scale x scale_2) and an `<base>.input_scale`. dgemma's own file so laid out (its e4m3 scales times 2
    or 4 per expert and half, exactly; scale_2 the inverse) gives the same logits."""
    from dgcli.checkpoint.gguf import GGUFFile, TensorOut, write_gguf

    fused = _quantized_gguf(tmp_path, capsys)
    f, tensors = GGUFFile(fused), []
    for name, info in f.tensors.items():
        base = name.removesuffix(".weight")
        if info.type != k.GGUF_NVFP4:
            if not (base.endswith("ffn_down_exps.scale") and f.tensors[base[:-6] + ".weight"].type == k.GGUF_NVFP4):
                tensors.append(TensorOut(name, info.shape, info.type, lambda name=name: f.array(name)))
            continue
        raw, rows = torch.from_numpy(np.array(f.array(name))).reshape(*info.shape[:-1], -1, 36).clone(), info.shape[-2]
        parts = [(base, raw)] if "gate_up" not in base else [
            (base.replace("gate_up", "gate"), raw[:, :rows // 2]), (base.replace("gate_up", "up"), raw[:, rows // 2:])]
        for i, (b, r) in enumerate(parts):
            factor = torch.tensor([2.0 ** (1 + (e + i) % 2) for e in range(r.shape[0] if r.dim() == 4 else 1)])
            d = r[..., :4].contiguous().view(torch.float8_e4m3fn).float() * factor.reshape(-1, *[1] * (r.dim() - 1))
            assert torch.equal(d.to(torch.float8_e4m3fn).float(), d)
            r[..., :4] = d.to(torch.float8_e4m3fn).view(torch.uint8)
            scale2 = 1 / factor
            if b.endswith("ffn_down_exps"):
                scale2 = scale2 * torch.from_numpy(np.array(f.array(b + ".scale")))
            tensors += [TensorOut(b + ".weight", (*r.shape[:-2], info.shape[-1]), k.GGUF_NVFP4,
                                  lambda r=r: r.flatten(-2).contiguous()),
                        TensorOut(b + ".scale", tuple(scale2.shape), 0, lambda s=scale2: s.float().numpy()),
                        TensorOut(b + ".input_scale", tuple(scale2.shape), 0, lambda n=scale2.numel(): np.full(n, 3.0, np.float32))]
    write_gguf(tmp_path / "llama.gguf", dict(f.metadata), tensors)
    names = {t.name for t in tensors}
    assert {"blk.0.ffn_gate_exps.scale", "blk.0.ffn_up_exps.input_scale", "blk.1.attn_q.scale"} <= names
    assert not any("gate_up" in n for n in names)
    assert torch.equal(logits(dgcli.load_model(tmp_path / "llama.gguf")), logits(dgcli.load_model(fused)))
