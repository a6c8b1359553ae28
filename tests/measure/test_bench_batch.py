"""`dgemma bench --batch-size 1,4` and `dgemma sweep --batch-size 1,4` on the bundled model: one row (or
cell) per batch size, the same quality at every size (answers are batch invariant), fuller batches run
fewer decoder passes, latency percentiles in order, bad sizes refused before any work; and the figures'
arithmetic on hand-made passes (weights counted once per batched decoder pass)."""

from __future__ import annotations

import json

import pytest

from cli_run import run
from dgcli.errors import UserError
from dgcli.measure import bench as b
from dgcli.measure import cost as info
from dgcli.measure import metrics
from dgcli.measure.grid import parse_batch_sizes
from dgcli.measure.metrics import Pass
from dgcli.runtime.request import Response
from dgcli.sampling.events import Done

SMALL = ["--num-prompts", "12", "--runs", "1", "--warmup", "0", "--no-measure-peaks"]
NEW = ("batch_size", "request_throughput", "p90_ttft_ms", "p90_e2el_ms", "mean_queue_ms", "slot_occupancy",
       "batched_decoder_passes")


@pytest.fixture(scope="module")
def rows():
    """bench --batch-size 1,4 (json) once for the module; capsys is function-scoped, so capture by hand."""
    from typer.testing import CliRunner

    from dgcli.cli import app

    r = CliRunner().invoke(app, ["bench", "--batch-size", "1,4", *SMALL, "--format", "json"])
    assert r.exit_code == 0, (r.output, r.exception)
    doc = json.loads(r.stdout)
    assert set(NEW) <= set(doc["definitions"])
    return doc["rows"]


def test_one_row_per_batch_size_with_the_same_quality(rows):
    one, four = rows
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert one["quality_metric"] == "exact_match" and one["quality"] is not None
    assert one["quality"] == four["quality"] and one["total_output_tokens"] == four["total_output_tokens"]
    assert one["diffusion_denoising_steps"] == four["diffusion_denoising_steps"]  # the same requests' steps
    assert one["slot_occupancy"] == 1 and one["batched_decoder_passes"] == one["diffusion_denoising_steps"]
    assert four["slot_occupancy"] > 0.5 and four["batched_decoder_passes"] < one["batched_decoder_passes"]
    assert four["mean_step_ms"] * four["batched_decoder_passes"] == pytest.approx(
        1e3 * four["diffusion_committed_tokens"] / four["diffusion_committed_throughput"])
    # FLOPs are per request; weight bytes once per batched pass, so batch 4 moves fewer bytes.
    assert one["denoise_flops"] == pytest.approx(four["denoise_flops"])
    assert four["denoise_bytes"] < one["denoise_bytes"]
    for r in rows:
        assert r["completed"] == 12 and r["runs"] == 1
        assert r["median_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"]
        assert r["median_e2el_ms"] <= r["p90_e2el_ms"] <= r["p99_e2el_ms"]
        assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"]
        assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])  # one pass
        assert r["request_throughput"] == pytest.approx(12 / r["duration"])
        assert r["mean_queue_ms"] > 0  # 12 requests, at most 4 slots: most wait for one
        assert set(r["spread"]) == set(metrics.SPREAD_KEYS)


def test_markdown_headline_shows_the_batch_size(capsys):
    code, out, _ = run(["bench", "--batch-size", "1,2", "--num-prompts", "2", "--runs", "1", "--warmup", "0",
                        "--no-measure-peaks", "--diffusion-steps", "4"], capsys)
    assert code == 0
    head = next(ln for ln in out.splitlines() if ln.startswith("| figure |"))
    assert head == "| figure | batch 1 | batch 2 | meaning |"  # a column per batch size
    assert "batch size 1, 2" in out and any(ln.startswith("| `slot_occupancy` |") for ln in out.splitlines())
    last = json.loads(out.strip().splitlines()[-1])
    assert [r["batch_size"] for r in last] == [1, 2]


@pytest.mark.parametrize("cmd", ["bench", "sweep"])
@pytest.mark.parametrize("bad", ["0", "-1", "x", "1,,2"])
def test_bad_batch_sizes_are_one_line_before_any_work(cmd, bad, capsys, monkeypatch, tmp_path):
    def no(*a, **k):
        raise AssertionError("measured peaks for a bad --batch-size")

    monkeypatch.setattr(b, "device_peaks", no)
    where = ["-o", str(tmp_path / "s.jsonl")] if cmd == "sweep" else []
    code, out, err = run([cmd, "--batch-size", bad, "--no-measure-peaks", *where], capsys)
    assert code == 2 and out == "", (out, err)
    assert err.startswith("dgemma: error: --batch-size") and err.count("\n") == 1 and ">= 1" in err, err


def test_parse_batch_sizes():
    assert parse_batch_sizes("1,2,4,8") == [1, 2, 4, 8] and parse_batch_sizes("4,1,4") == [4, 1]
    for bad in ("0", "-1", "x", "1,,2", "", "1.5"):
        with pytest.raises(UserError, match="--batch-size"):
            parse_batch_sizes(bad)


# ---- sweep: a batch-size axis ----------------------------------------------------------------------------


def test_sweep_batch_axis_keeps_quality_and_resumes(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    args = ["sweep", "--batch-size", "1,4", "--diffusion-steps", "8", *SMALL, "-o", str(out), "--format", "jsonl"]
    code, stdout, err = run(args, capsys)
    assert code == 0, err
    cells = [json.loads(ln) for ln in out.read_text().splitlines()]
    cells = [c for c in cells if c["kind"] == "cell"]
    assert [c["cell"] for c in cells] == [{"batch_size": 1}, {"batch_size": 4}]
    assert [json.loads(c["cell_key"]) for c in cells] == [{"batch_size": 1}, {"batch_size": 4}]
    assert cells[0]["quality_metric"] == "exact_match" and cells[0]["quality"] == cells[1]["quality"]
    assert cells[1]["slot_occupancy"] > 0.5 and cells[1]["batched_decoder_passes"] < cells[0]["batched_decoder_passes"]
    code, _, err = run([*args, "--resume"], capsys)  # nothing left to run
    assert code == 0 and "nothing left to run" in err
    code, _, err = run([*args[:2], "1,4,2", *args[3:], "--resume"], capsys)  # a wider axis runs the new size
    assert code == 0 and "1 to run" in err and len(out.read_text().splitlines()) == 3


def test_sweep_agreement_does_not_depend_on_the_batch_size(tmp_path, capsys):
    """Without answers quality is agreement with the reference output (run one request at a time): every
    batch size must reproduce it exactly."""
    from dgcli.measure.workload import default_prompt_file

    rows = [json.loads(ln) for ln in default_prompt_file().read_text().splitlines()][::8]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    out = tmp_path / "a.jsonl"
    code, _, err = run(["sweep", "--prompts", str(f), "--batch-size", "1,5", "--runs", "1", "--warmup", "0",
                        "--no-measure-peaks", "-o", str(out), "--format", "jsonl"], capsys)
    assert code == 0, err
    cells = [c for c in map(json.loads, out.read_text().splitlines()) if c["kind"] == "cell"]
    assert [c["quality_metric"] for c in cells] == ["agreement"] * 2
    assert [c["agreement"] for c in cells] == [1.0, 1.0]


# ---- the figures' arithmetic on hand-made passes ------------------------------------------------------------


def _resp(steps: int, c: int, prefix: int = 8) -> Response:
    t = {"prefill_s": 0.01, "denoise_s": 0.001 * steps, "commit_s": 0.0, "first_block_s": 0.01 + 0.001 * steps,
         "total_s": 0.01 + 0.001 * steps}
    done = Done(token_ids=[5] * 3, finish_reason="stop", stop_id=1, blocks=1, steps_per_block=[steps],
                decoder_passes=steps, tokens_per_forward=4 / steps, timings=t)
    return Response([0] * prefix, done.token_ids, "stop", done, None, [prefix])


def test_weights_count_once_per_batched_decoder_pass():
    from hf_oracle import CLI_TEXT as TEXT

    from dgcli.checkpoint.config import parse_config
    from dgcli.checkpoint.random_weights import make_config

    cfg = parse_config(make_config(TEXT, canvas_length=8))
    reqs = [_resp(3, 8), _resp(3, 8)]
    one_by_one = Pass(reqs, wall_s=0.026, batch_size=1, decoder_passes=6, row_steps=6, denoise_s=0.006,
                      queue_s=[0.0, 0.0], ttft_s=[0.013, 0.013], e2el_s=[0.013, 0.013])
    seq = metrics.summarize([one_by_one], cfg, 3, weight_bytes=4, peaks=None)
    want = sum(info.block_cost(cfg, 8, 3, 3, weight_bytes=4).bytes for _ in reqs)
    assert seq["denoise_bytes"] == pytest.approx(want)  # batch 1: the card's per-request accounting
    both = Pass(reqs, wall_s=0.02, batch_size=2, decoder_passes=3, row_steps=6, denoise_s=0.003,
                queue_s=[0.0, 0.0], ttft_s=[0.013, 0.013], e2el_s=[0.013, 0.013])
    row = metrics.summarize([both], cfg, 3, weight_bytes=4, peaks=None)
    kv = sum(info.block_cost(cfg, 8, 3, 3, weight_bytes=0, kv_bytes=4).bytes for _ in reqs)
    weights_seq, weights_batch = seq["denoise_bytes"] - kv, row["denoise_bytes"] - kv
    # Three passes instead of six: half the weight traffic, a little more for the experts 2 x 8 tokens touch.
    assert 0.5 * weights_seq < weights_batch < weights_seq
    assert row["denoise_flops"] == pytest.approx(seq["denoise_flops"])
    assert row["batched_decoder_passes"] == 3 and row["diffusion_denoising_steps"] == 6
    assert row["slot_occupancy"] == 1 and row["mean_step_ms"] == pytest.approx(1.0)
    assert row["output_throughput"] == pytest.approx(6 / 0.02) and row["request_throughput"] == pytest.approx(100)
    half = Pass(reqs, 0.02, 4, 3, 6, 0.003, [0.0, 0.0], [0.013, 0.013], [0.013, 0.013])
    assert metrics.summarize([half], cfg, 3, weight_bytes=4, peaks=None)["slot_occupancy"] == 0.5
