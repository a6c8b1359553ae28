"""GGUF files: our reader against the `gguf` package's (the oracle), the file `dgemma quantize --type` writes
against one written here with `gguf.GGUFWriter` in llama.cpp's DiffusionGemma layout (names, shapes, metadata,
tokenizer typed as llama.cpp's converter types it), the bundled model as F32 / BF16 / Q8_0 GGUF against its
safetensors directory, llama.cpp's Q4_K_M type mix, and one line for each broken file."""

import dataclasses
import json
from pathlib import Path

import gguf as G
import numpy as np
import pytest
import torch

from dgcli.checkpoint import gguf_model
from dgcli.model import ggml
from dgcli.model.gemma import Experts
from dgcli.checkpoint.gguf import GGUFFile
from dgcli.checkpoint.load import load_config, load_generation_config
from dgcli.checkpoint.load import load_model
from dgcli.checkpoint.quantize import checkpoint_to_gguf, gguf_types
from dgcli.checkpoint.random_weights import write_random_checkpoint
from dgcli.runtime.session import BUNDLED
from dgcli.text.tokenizer import load_tokenizer

S, F = "sliding_attention", "full_attention"
# Every row length a multiple of 32 (Q8_0 everywhere); 3 layers: two attn_v, one K=V full layer.
SMALL = dict(vocab_size=400, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=32,
             global_head_dim=64, num_experts=4, top_k_experts=2, sliding_window=16, layer_types=[S, S, F],
             max_position_embeddings=4096)
TEXTS = ["Sort: 7 2 9 2", "Reverse: c a t", "hello  wide\tworld\n\nnew <unused_5> é 漢", "<|turn>user\nhi<turn|>\n"]


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("gguf") / "ck", SMALL, canvas_length=8, seed=3)


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    """The bundled model as F32, BF16 and Q8_0 GGUF files (what `dgemma quantize --type` writes)."""
    d = tmp_path_factory.mktemp("bundled")
    return {k: checkpoint_to_gguf(BUNDLED, d / f"tiny-{k}.gguf", k) and d / f"tiny-{k}.gguf"
            for k in ("f32", "bf16", "q8_0")}


# ---- the reference layout, written with the gguf package as llama.cpp's converter names things ----------

LAYER_NAMES = {  # checkpoint key tail -> llama.cpp tensor name tail (convert_hf_to_gguf's Gemma-4 map)
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "layer_scalar": "layer_output_scale.weight",
}
TOP_NAMES = {"model.decoder.embed_tokens.weight": "token_embd.weight", "model.decoder.norm.weight": "output_norm.weight",
             "model.decoder.self_conditioning.pre_norm.weight": "self_cond_pre_norm.weight",
             "model.decoder.self_conditioning.gate_proj.weight": "self_cond_gate.weight",
             "model.decoder.self_conditioning.up_proj.weight": "self_cond_up.weight",
             "model.decoder.self_conditioning.down_proj.weight": "self_cond_down.weight"}


def llama_cpp_name(key: str) -> str | None:
    if key in TOP_NAMES:
        return TOP_NAMES[key]
    for prefix, enc in (("model.decoder.layers.", False), ("model.encoder.language_model.layers.", True)):
        if key.startswith(prefix):
            layer, tail = key[len(prefix):].split(".", 1)
            if enc:
                return f"blk.{layer}.enc_layer_output_scale.weight" if tail == "layer_scalar" else None
            return f"blk.{layer}.{LAYER_NAMES[tail]}"
    return None  # vision


def write_reference(ckpt: Path, path: Path, quantize: bool) -> None:
    """A GGUF file of checkpoint `ckpt` laid out as llama.cpp's DiffusionGemma converter writes it (matrices
    Q8_0 when `quantize`, else F32; norms, scales and the router F32), with the gguf package's writer."""
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    t = cfg["text_config"]
    gen = json.loads((ckpt / "generation_config.json").read_text())
    tok_json = json.loads((ckpt / "tokenizer.json").read_text())
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    w = G.GGUFWriter(str(path), "diffusion-gemma")
    w.add_block_count(t["num_hidden_layers"])
    w.add_context_length(t["max_position_embeddings"])
    w.add_embedding_length(t["hidden_size"])
    w.add_feed_forward_length(t["intermediate_size"])
    w.add_head_count(t["num_attention_heads"])
    swa = [lt == S for lt in t["layer_types"]]
    w.add_head_count_kv([t["num_key_value_heads"] if s else t["num_global_key_value_heads"] for s in swa])
    w.add_rope_freq_base(t["rope_parameters"][F]["rope_theta"])
    w.add_rope_freq_base_swa(t["rope_parameters"][S]["rope_theta"])
    w.add_layer_norm_rms_eps(t["rms_norm_eps"])
    w.add_expert_count(t["num_experts"])
    w.add_expert_used_count(t["top_k_experts"])
    w.add_key_length(t["global_head_dim"])
    w.add_value_length(t["global_head_dim"])
    w.add_final_logit_softcapping(t["final_logit_softcapping"])
    w.add_sliding_window(t["sliding_window"])
    w.add_sliding_window_pattern(swa)
    w.add_key_length_swa(t["head_dim"])
    w.add_value_length_swa(t["head_dim"])
    w.add_expert_feed_forward_length(t["moe_intermediate_size"])
    w.add_rope_dimension_count(t["global_head_dim"])
    w.add_rope_dimension_count_swa(t["head_dim"])
    w.add_causal_attention(False)
    w.add_uint32("diffusion.canvas_length", cfg["canvas_length"])
    w.add_uint32("diffusion.eb_max_steps", gen["max_denoising_steps"])
    w.add_float32("diffusion.eb_t_min", gen["t_min"])
    w.add_float32("diffusion.eb_t_max", gen["t_max"])
    w.add_float32("diffusion.eb_entropy_bound", gen["sampler_config"]["entropy_bound"])
    w.add_uint32("diffusion.eb_stability_threshold", gen["stability_threshold"])
    w.add_float32("diffusion.eb_confidence_threshold", gen["confidence_threshold"])
    # The tokenizer as llama.cpp's Gemma-4 converter types it: CONTROL for transformers' special tokens,
    # USER_DEFINED for the visible ones, BYTE for <0x..>, NORMAL for the rest (the <unused_N> placeholders too).
    vocab = {**tok_json["model"]["vocab"], **{a["content"]: a["id"] for a in tok_json["added_tokens"]}}
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    control = {tok_cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")}
    control |= set(tok_cfg["extra_special_tokens"])
    visible = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
    types = [G.TokenType.USER_DEFINED if x in visible else G.TokenType.CONTROL if x in control
             else G.TokenType.BYTE if x.startswith("<0x") and len(x) == 6 else G.TokenType.NORMAL for x in tokens]
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * len(tokens))
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) for m in tok_json["model"]["merges"]])
    for add, name in ((w.add_bos_token_id, "<bos>"), (w.add_eos_token_id, "<eos>"), (w.add_unk_token_id, "<unk>"),
                      (w.add_pad_token_id, "<pad>"), (w.add_mask_token_id, "<mask>")):
        add(vocab[name])
    w.add_chat_template((ckpt / "chat_template.jinja").read_text())
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    n_rot = int(t["global_head_dim"] * t["rope_parameters"][F]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (t["global_head_dim"] // 2 - n_rot), np.float32))
    for key, arr in load_file(str(ckpt / "model.safetensors")).items():
        name = llama_cpp_name(key)
        if name is None:
            continue
        arr = arr.astype(np.float32)
        if quantize and arr.ndim >= 2 and ".ffn_gate_inp." not in name:
            w.add_tensor(name, G.quants.quantize(arr, G.GGMLQuantizationType.Q8_0),
                         raw_dtype=G.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def same_as_package(path: Path) -> None:
    """Every metadata value and every tensor (shape, type, bytes) as `gguf.GGUFReader` reads them."""
    ours, ref = GGUFFile(path), G.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert keys == list(ours.metadata)
    for k in keys:
        mine, theirs = ours.metadata[k], ref.fields[k].contents()
        mine = mine.tolist() if isinstance(mine, np.ndarray) else mine
        assert mine == theirs, k
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.type, tuple(reversed(info.shape))) == (int(t.tensor_type), tuple(int(x) for x in t.shape)), t.name
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert ours.data(t.name).tobytes() == np.asarray(t.data).tobytes(), t.name


def logits(model):
    """Canvas logits of a fixed random prompt and canvas, with every weight first copied to fresh (64-byte
    aligned) memory: CPU fp32 GEMMs round differently with the operands' alignment (a safetensors mapping
    puts tensors at any offset, GGUF at multiples of 32; up to 2e-6 apart on the same bits), and this compares
    weights, not where they lie."""
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    g = torch.Generator().manual_seed(0)
    v = model.config.vocab_size
    return model.forward_canvas(torch.randint(0, v, (1, 9), generator=g),
                                torch.randint(0, v, (1, model.config.canvas_length), generator=g))


# ---- the tests ---------------------------------------------------------------------------------------

def test_reader_matches_the_gguf_package(bundled_gguf, small_ckpt, tmp_path):
    same_as_package(bundled_gguf["q8_0"])  # our writer
    write_reference(small_ckpt, tmp_path / "ref.gguf", quantize=True)  # the package's writer
    same_as_package(tmp_path / "ref.gguf")


def test_a_given_alignment_is_the_datas(tmp_path):
    """`general.alignment` in the metadata written is where the data lies too, as the package's reader finds it."""
    from dgcli.checkpoint.gguf import TensorOut, write_gguf

    arrs = {"a": np.arange(5, dtype=np.float32), "b": np.arange(7, dtype=np.float32) * 2}
    write_gguf(tmp_path / "x.gguf", {"general.alignment": 64},
               [TensorOut(n, a.shape, 0, lambda a=a: a) for n, a in arrs.items()])
    ours = GGUFFile(tmp_path / "x.gguf")
    for t in G.GGUFReader(str(tmp_path / "x.gguf")).tensors:
        assert t.data_offset % 64 == 0 and np.array_equal(t.data, arrs[t.name]), t.name
        assert np.array_equal(ours.array(t.name), arrs[t.name])


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q8_0"])
def test_quantize_and_reference_layout_load_the_same(small_ckpt, tmp_path, quantize):
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    write_reference(small_ckpt, ref, quantize)
    checkpoint_to_gguf(small_ckpt, ours, "q8_0" if quantize else "f32")
    # Same bytes per tensor: the same names, shapes, types, and Q8_0 rounded as the package rounds.
    a, b = GGUFFile(ref), GGUFFile(ours)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].type == b.tensors[name].type, name
        assert a.data(name).tobytes() == b.data(name).tobytes(), name
    cfg = load_config(ref)
    # The config.json's, but for the dtype: a quantized file's runs in bfloat16 (the embedding's type decides).
    assert cfg == load_config(ours)
    assert cfg.dtype == ("bfloat16" if quantize else "float32")
    assert dataclasses.replace(cfg, dtype="float32") == load_config(small_ckpt)
    # The sampler defaults: all of generation_config.json in ours; llama.cpp's keys carry no token budget, and
    # its stop ids are looked up by name (<eos>, <turn|>, <|tool_response>).
    want_gen = json.loads((small_ckpt / "generation_config.json").read_text())
    assert load_generation_config(ours) == want_gen
    assert load_generation_config(ref) == {k: v for k, v in want_gen.items() if k != "max_new_tokens"}
    m_ref, m_ours = gguf_model.load_gguf_model(ref, dtype=torch.float32), gguf_model.load_gguf_model(ours, dtype=torch.float32)
    assert torch.equal(logits(m_ref), logits(m_ours))
    if quantize:
        assert isinstance(m_ours.layers[0].self_attn.q_proj, ggml.QuantLinear)
        assert isinstance(m_ours.layers[0].experts, ggml.QuantExperts)
    else:
        assert torch.equal(logits(m_ours), logits(load_model(small_ckpt)))
    # The tokenizer of either file gives the checkpoint tokenizer's ids (llama.cpp types <unused_N> NORMAL).
    want = load_tokenizer(small_ckpt)
    for path in (ref, ours):
        tok = gguf_model.load_gguf_tokenizer(path)
        assert tok.special_ids == want.special_ids and tok.chat_template == want.chat_template
        for text in TEXTS:
            assert tok.encode_prompt(text) == want.encode_prompt(text), text
            assert tok.decode(want.encode_text(text)) == want.decode(want.encode_text(text))


def test_bundled_tokenizer_ids_equal(bundled_gguf):
    import dgcli
    from dgcli.text.prompts import read_prompt_file

    want, tok = load_tokenizer(BUNDLED), gguf_model.load_gguf_tokenizer(bundled_gguf["q8_0"])
    prompts = [r["prompt"] for r in read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")] + TEXTS
    for p in prompts:
        assert tok.encode_prompt(p) == want.encode_prompt(p), p
    assert (tok.stop_ids, tok.special_ids, tok.vocab_size) == (want.stop_ids, want.special_ids, want.vocab_size)


def _runs(model, dtype, n=10):
    import dgcli
    from dgcli.cli.options import sampler_flags
    from dgcli.runtime import request
    from dgcli.runtime.session import open_session
    from dgcli.text.prompts import read_prompt_file

    s = open_session(model, None, sampler_flags(blocks=4, seed=0, device="cpu", dtype=dtype))
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")[::9][:n]
    out = []
    for row in rows:
        r = request.run(s, request.encode(s, row["prompt"]))
        out.append((r.text, list(r.done.steps_per_block)))
    return s, out


def test_bundled_f32_gguf_gives_the_same_tokens_and_steps(bundled_gguf):
    s_dir, want = _runs(None, "auto")
    s_gguf, got = _runs(str(bundled_gguf["f32"]), "auto")
    assert s_gguf.config == s_dir.config and s_gguf.resolved.params == s_dir.resolved.params
    assert s_gguf.stop_ids == s_dir.stop_ids and s_gguf.num_blocks == s_dir.num_blocks
    assert got == want


def test_bundled_bf16_gguf_equals_the_bf16_run(bundled_gguf):
    assert _runs(str(bundled_gguf["bf16"]), "auto")[1] == _runs(None, "bfloat16")[1]


def test_q4_k_m_mix_is_llama_cpps():
    n = 16
    shapes = {"token_embd.weight": (1024, 512), "output_norm.weight": (512,), "rope_freqs.weight": (64,),
              "self_cond_gate.weight": (512, 512), "blk.0.attn_k.weight": (100, 96)}  # row 96: no K-quant, Q5_0
    for i in range(n):
        shapes |= {f"blk.{i}.attn_v.weight": (256, 512), f"blk.{i}.ffn_down.weight": (512, 1024),
                   f"blk.{i}.ffn_down_exps.weight": (4, 512, 256), f"blk.{i}.ffn_gate_inp.weight": (4, 512),
                   f"blk.{i}.ffn_gate_up_exps.weight": (4, 512, 512), f"blk.{i}.layer_output_scale.weight": (1,)}
    shapes["blk.1.attn_output.weight"] = (512, 100)  # row 100: not even Q8_0's blocks, F16
    t = gguf_types("q4_k_m", shapes, n)
    more = [0, 1, 4, 7, 10, 13, 14, 15]  # use_more_bits(i, 16): first and last eighth, every third between
    assert [i for i in range(n) if t[f"blk.{i}.ffn_down.weight"] == ggml.Q6_K] == more
    assert [i for i in range(n) if t[f"blk.{i}.ffn_down_exps.weight"] == ggml.Q6_K] == more
    assert [i for i in range(n) if t[f"blk.{i}.attn_v.weight"] == ggml.Q6_K] == more
    assert t["token_embd.weight"] == ggml.Q6_K and t["self_cond_gate.weight"] == ggml.Q4_K
    assert t["blk.2.ffn_gate_up_exps.weight"] == t["blk.2.ffn_down.weight"] == ggml.Q4_K
    assert t["blk.0.ffn_gate_inp.weight"] == t["output_norm.weight"] == t["blk.0.layer_output_scale.weight"] == ggml.F32
    assert (t["blk.0.attn_k.weight"], t["blk.1.attn_output.weight"]) == (ggml.Q5_0, ggml.F16)  # llama.cpp's fallbacks
    shapes["blk.0.ffn_down.weight"] = (512, 96)  # a "more bits" layer's Q6_K falls back to Q8_0
    assert gguf_types("q4_k_m", shapes, n)["blk.0.ffn_down.weight"] == ggml.Q8_0
    q8 = gguf_types("q8_0", shapes, n)
    assert q8["token_embd.weight"] == q8["blk.3.attn_v.weight"] == ggml.Q8_0 and q8["rope_freqs.weight"] == ggml.F32
    assert gguf_types("bf16", shapes, n)["blk.3.ffn_down.weight"] == ggml.BF16


def test_q4_k_m_file_of_a_random_config_runs_quantized(tmp_path):
    # Row lengths of 256: the K-quants apply (Q4_K, and Q6_K for the embedding and the "more bits" layers).
    text = dict(SMALL, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=128,
                global_head_dim=128)
    ck = write_random_checkpoint(tmp_path / "ck", text, canvas_length=8, seed=5)
    checkpoint_to_gguf(ck, tmp_path / "m.gguf", "q4_k_m")
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.tensors["token_embd.weight"].type == ggml.Q6_K and f.tensors["blk.1.ffn_up.weight"].type == ggml.Q4_K
    m = gguf_model.load_gguf_model(tmp_path / "m.gguf")
    assert m.embed_weight.dtype == torch.bfloat16  # the quantized embedding, dequantized at load
    assert isinstance(m.layers[1].mlp.up_proj, ggml.QuantLinear) and m.layers[1].experts.types == (ggml.Q4_K, ggml.Q4_K)
    assert m.layers[2].experts.types == (ggml.Q4_K, ggml.Q6_K)  # use_more_bits(2, 3): the last eighth
    # Each module holds its own tensor's blocks: what it computes with is the file's bytes dequantized (the
    # kernel keeps scales in bf16: within 1% of the largest value).
    for layer in (0, 2):
        q = m.layers[layer].self_attn.q_proj.dequantized()
        raw = torch.from_numpy(f.array(f"blk.{layer}.attn_q.weight"))
        want = ggml.dequantize(raw, f.tensors[f"blk.{layer}.attn_q.weight"].type, q.shape[-1])
        assert torch.allclose(q, want, atol=0.01 * want.abs().max().item())
        down = m.layers[layer].experts.dequantized()[1]
        want = ggml.dequantize(torch.from_numpy(f.array(f"blk.{layer}.ffn_down_exps.weight")),
                               f.tensors[f"blk.{layer}.ffn_down_exps.weight"].type, down.shape[-1])
        assert torch.allclose(down, want, atol=0.01 * want.abs().max().item())
    # And the model runs as the same weights dequantized into a plain bf16 model do.
    dense = gguf_model.load_gguf_model(tmp_path / "m.gguf")
    for name, mod in list(dense.named_modules()):
        if isinstance(mod, ggml.QuantLinear):
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=False)
            lin.weight = torch.nn.Parameter(mod.dequantized().bfloat16())
            dense.set_submodule(name, lin)
        elif isinstance(mod, ggml.QuantExperts):
            ex = Experts(dense.config).to(torch.bfloat16)
            gu, dn = mod.dequantized()
            ex.gate_up_proj, ex.down_proj = torch.nn.Parameter(gu.bfloat16()), torch.nn.Parameter(dn.bfloat16())
            dense.set_submodule(name, ex)
    # Bound: this random model's bf16 logits differ from its fp32 ones by about as much (cosine 0.997, max
    # 0.52 of the ±30 softcap): bf16 rounding in another kernel's order, amplified by random layers.
    got, want = logits(m).float(), logits(dense).float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99, (got - want).abs().max()


@pytest.mark.slow
def test_bundled_q8_0_heldout_exact_match_within_5_points(bundled_gguf, bundled_heldout):
    """~8 s beside the shared fp32 run (the bundled_heldout fixture): Q8_0 weights, bf16 activations."""
    import dgcli
    from dgcli.cli.options import sampler_flags
    from dgcli.measure.sweep import exact_match
    from dgcli.runtime import request
    from dgcli.runtime.session import open_session
    from dgcli.train import tasks

    exs = tasks.read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")
    _, _, base = bundled_heldout
    s = open_session(str(bundled_gguf["q8_0"]), None, sampler_flags(blocks=4, seed=0, device="cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = [request.run(s, request.encode(s, ex.prompt)) for ex in exs]
    finally:
        torch.set_num_threads(threads)

    def score(responses):
        pairs = [(r.text, ex.answer) for r, ex in zip(responses, exs) if ex.answer is not None]
        return sum(exact_match(t, a) for t, a in pairs) / len(pairs)

    assert abs(score(got) - score(base)) <= 0.05, (score(got), score(base))
