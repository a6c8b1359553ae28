"""GGUF files at the command line: `dgemma quantize SRC DST.gguf --type T` writes one that `generate -m` and `info`
run, its summary is one line, bad flags are one line; a broken file (cut short, another architecture, an
unsupported type, a missing or foreign tensor) is one line, exit 2; `info` shows bytes by type and the fit.
(The file format itself: tests/model/test_gguf.py.)"""

import json

import gguf as G
import numpy as np
import pytest

from cli_run import run
from dgcli.errors import UserError
from dgcli.checkpoint import gguf_model
from dgcli.model import ggml
from dgcli.checkpoint.gguf import GGUFFile
from dgcli.checkpoint.quantize import checkpoint_to_gguf
from dgcli.runtime.session import BUNDLED


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("bundled")
    return {k: checkpoint_to_gguf(BUNDLED, d / f"tiny-{k}.gguf", k) and d / f"tiny-{k}.gguf" for k in ("f32", "q8_0")}


def test_quantize_to_gguf_then_run(cli_ckpt, tmp_path, capsys):
    dst = tmp_path / "m-q8_0.gguf"
    code, out, err = run(["quantize", str(cli_ckpt), str(dst), "--type", "q8_0"], capsys)
    assert code == 0, err
    assert out.startswith(f"{dst}: GGUF Q8_0") and out.count("\n") == 1 and "F32" in out, out
    want = run(["generate", "--model", str(cli_ckpt), "--diffusion-steps", "2", "--format", "json", "--dtype",
                "bfloat16", "hello"], capsys)
    got = run(["generate", "--model", str(dst), "--diffusion-steps", "2", "--format", "json", "hello"], capsys)
    assert got[0] == 0, got[2]
    row = json.loads(got[1])
    assert row["finish_reason"] in ("stop", "length") and row["settings"]["run"]["dtype"] == "bfloat16"
    assert row["prompt_tokens"] == json.loads(want[1])["prompt_tokens"]  # the same tokenizer, from the file
    code, out, err = run(["info", str(dst), "--no-measure-peaks", "--format", "json"], capsys)
    assert code == 0 and "Q8_0" in json.loads(out)["bytes_by_dtype"], err


def test_quantize_gguf_flag_errors_are_one_line(cli_ckpt, tmp_path, capsys):
    (tmp_path / "there.gguf").write_bytes(b"x")
    for argv, needle in ((["--type", "q5_k"], "--type q5_k: use one of f32, bf16, q8_0, q4_k_m"),
                         (["--type", "q8_0", "--fp8"], "give one format"),
                         (["--type", "q8_0", "DST=" + str(tmp_path / "m.bin")], "ends in .gguf"),
                         (["--type", "q8_0", "DST=" + str(tmp_path / "there.gguf")], "exists")):
        dst = next((a[4:] for a in argv if a.startswith("DST=")), str(tmp_path / "m.gguf"))
        code, out, err = run(["quantize", str(cli_ckpt), dst, *[a for a in argv if not a.startswith("DST=")]], capsys)
        assert code == 2 and out == "", err
        assert err.startswith("dgemma: error:") and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("case", ["truncated", "header", "arch", "alignment", "q4_1", "missing", "output"])
def test_broken_files_are_one_line(bundled_gguf, tmp_path, capsys, case):
    path = tmp_path / "bad.gguf"
    good = bundled_gguf["f32"].read_bytes()
    if case in ("truncated", "header"):
        path.write_bytes(good[:-1000] if case == "truncated" else good[:200])
        needle = "cut short"
    elif case == "arch":
        w = G.GGUFWriter(str(path), "llama")
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        needle = "architecture is 'llama'"
    elif case == "alignment":  # the data lies at 32, the key says 0
        w = G.GGUFWriter(str(path), "diffusion-gemma")
        w.add_uint32("general.alignment", 0)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        needle = "general.alignment 0 is not a power of two"
    else:  # the bundled F32 file, rewritten with one tensor changed (our writer: the case is the reader's)
        from dgcli.checkpoint.gguf import TensorOut, write_gguf

        src = GGUFFile(bundled_gguf["f32"])
        tensors = []
        for name, info in src.tensors.items():
            if case == "missing" and name == "blk.2.ffn_up.weight":
                continue
            if case == "q4_1" and name == "blk.1.attn_q.weight":
                q = G.quants.quantize(src.array(name), G.GGMLQuantizationType.Q4_1)
                tensors.append(TensorOut(name, info.shape, 3, lambda q=q: q))
                continue
            tensors.append(TensorOut(name, info.shape, info.type, lambda name=name: src.array(name)))
        if case == "output":
            info = src.tensors["token_embd.weight"]
            tensors.append(TensorOut("output.weight", info.shape, info.type, lambda: src.array("token_embd.weight")))
        write_gguf(path, dict(src.metadata), tensors)
        needle = {"q4_1": "'blk.1.attn_q.weight' is Q4_1", "missing": "lacks tensor 'blk.2.ffn_up.weight'",
                  "output": "'output.weight'"}[case]
    for argv in (["generate", "-m", str(path), "hi"], ["info", str(path), "--no-measure-peaks"]):
        if argv[0] == "info" and case in ("q4_1", "missing", "output"):
            continue  # info reads no weights
        code, out, err = run(argv, capsys)
        assert code == 2 and out == "", err
        assert err.startswith("dgemma: error:") and err.count("\n") == 1 and needle in err, err
    with pytest.raises(UserError):
        gguf_model.load_gguf_model(path)


def test_info_reports_bytes_by_type_and_fit(bundled_gguf, capsys):
    code, out, err = run(["info", str(bundled_gguf["q8_0"]), "--no-measure-peaks", "--format", "json"], capsys)
    assert code == 0, err
    card = json.loads(out)
    f = GGUFFile(bundled_gguf["q8_0"])
    assert card["bytes_by_dtype"] == {"Q8_0": sum(t.nbytes for t in f.tensors.values() if t.type == ggml.Q8_0),
                                      "F32": sum(t.nbytes for t in f.tensors.values() if t.type == ggml.F32)}
    assert card["dtype"] == "bfloat16" and card["gguf"]["fits_ram"] is True
    assert card["memory"]["weights"] == card["gguf"]["weights_loaded"] < 2 * f.path.stat().st_size
    code, out, err = run(["info", "-m", str(bundled_gguf["q8_0"]), "--no-measure-peaks"], capsys)
    assert code == 0 and "## GGUF file" in out and "Q8_0" in out and "it fits" in out


def test_bench_card_counts_the_bytes_a_gguf_model_holds(bundled_gguf, capsys):
    """bench's card: a quantized file's weights as the loaded model holds them (GGML blocks in their kernels'
    form, not the config at bf16), and the source names the GGUF file."""
    code, out, err = run(["bench", "-m", str(bundled_gguf["q8_0"]), "--runs", "1", "--num-prompts", "1",
                          "--no-measure-peaks", "--format", "json"], capsys)
    assert code == 0, err
    card = json.loads(out)["card"]
    from dgcli.measure.cost import weights_bytes_total
    from dgcli.checkpoint.load import load_config

    bf16 = weights_bytes_total(load_config(bundled_gguf["q8_0"]), 2)
    assert card["source"].startswith("GGUF file") and "uint8" in card["bytes_by_dtype"]
    assert card["memory"]["weights"] == sum(card["bytes_by_dtype"].values()) < bf16


def test_a_cluster_driver_reads_a_gguf_files_own_tokenizer(bundled_gguf):
    """`--ray` with `-m FILE.gguf`: the driver encodes prompts and writes answers with the file's tokenizer (it looked
    for FILE.gguf/tokenizer.json: generate stopped, bench answered padding). A stand-in pool, no cluster."""
    import dataclasses

    from dgcli.cluster import jobs
    from dgcli.runtime.session import open_session

    shadow = dataclasses.replace(open_session(str(bundled_gguf["q8_0"]), None, {}), tokenizer=None)

    class Pool:
        def call(self, what, *args):
            return shadow, [], {}

    session = jobs.driver_session(Pool())[0]
    assert session.tokenizer is not None and session.tokenizer.encode_text("Sort: 7 2") == \
        open_session(None, None, {}).tokenizer.encode_text("Sort: 7 2")
