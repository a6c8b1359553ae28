"""`dgemma bench` on a random checkpoint: every figure present with sane values in fixed-work mode, the
md/csv/jsonl printers render the same record, dummy weights, Ctrl-C, and the figures' arithmetic on
hand-made requests (bimodal step counts)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from dgcli.measure import bench as b
from dgcli.measure import metrics
from dgcli.checkpoint.random_weights import dummy_config
from dgcli.runtime import request, session
from dgcli.runtime.request import Response
from dgcli.measure import cost as info
from dgcli.measure import printers as report
from dgcli.checkpoint.load import load_config
from dgcli.errors import UserError
from dgcli.sampling.events import Done

from hf_oracle import CLI_CANVAS as C
from hf_oracle import F, S
from hf_oracle import CLI_TEXT as TEXT
QUALITY = ("quality", "exact_match", "agreement", "quality_metric", "answered_prompts")


@pytest.fixture(scope="module")
def ckpt(cli_ckpt):
    return cli_ckpt


def run(*args, code=0):
    from dgcli.cli import app

    r = CliRunner().invoke(app, ["bench", *args])
    assert r.exit_code == code, (r.output, r.exception)
    return r


FIXED = ["--diffusion-steps", "3", "--confidence-threshold", "0", "--blocks", "2", "--random-prompts",
         "--num-prompts", "2", "--random-input-len", "10", "--ignore-eos", "--no-measure-peaks"]


@pytest.fixture(scope="module")
def doc(ckpt):
    r = run("--model", str(ckpt), *FIXED, "--runs", "2", "--warmup", "1", "--format", "json", "--label", "t",
            "--metadata", "k=v")
    return json.loads(r.stdout)


def test_json_has_every_figure_with_sane_fixed_work_values(doc, ckpt):
    row = doc["rows"][0]
    missing = [k for k in metrics.DEFINITIONS if k not in row and k not in QUALITY
               and k not in ("peak_flops_per_s", "peak_compute", "peak_bytes_per_s", "flops_utilization",
                             "bandwidth_utilization",
                             "floor_step_ms", "floor_bound", "step_vs_floor", "peak_flops_range",
                             "peak_bytes_range") and k not in metrics.IMAGE_FIGURES]  # need peaks: checked below
    assert not missing
    assert set(doc["definitions"]) == set(metrics.DEFINITIONS)
    # Fixed work: every block runs the cap; --ignore-eos: every request runs both blocks.
    assert row["completed"] == 4 and row["mean_blocks_per_request"] == 2
    assert row["diffusion_steps_per_canvas"] == 3 and row["cap_hit_rate"] == 1 == row["cap_steps_share"]
    assert row["p50_steps_per_block"] == row["p90_steps_per_block"] == row["p99_steps_per_block"] == 3
    assert row["steps_histogram"] == {"3": 8}
    assert row["diffusion_denoising_steps"] == 4 * 2 * 3
    assert row["diffusion_canvas_positions"] == 24 * C and row["diffusion_committed_tokens"] == 8 * C
    assert row["diffusion_committed_per_step"] == pytest.approx(C / 3)
    assert row["total_output_tokens"] == 8 * C and row["finish_length_rate"] == 1
    assert row["output_throughput"] > 0 and row["output_throughput_std"] >= 0
    assert 0 < row["mean_ttft_ms"] < row["mean_e2el_ms"] and row["mean_step_ms"] > 0 and row["mean_commit_ms"] > 0
    assert row["diffusion_committed_throughput"] > row["output_throughput"]  # denoising time < end to end
    assert row["diffusion_canvas_positions_per_s"] == pytest.approx(3 * row["diffusion_committed_throughput"])
    assert isinstance(row["peak_memory_bytes"], int) and row["peak_memory_bytes"] >= 0
    assert "ru_maxrss" in row["peak_memory_method"]
    # FLOPs: each of the 4 requests denoises block 0 after its 10 prompt ids and block 1 after 10 + C.
    cfg = load_config(ckpt)
    want = sum(info.block_cost(cfg, p, 3, 3, weight_bytes=4).flops for p in (10, 10 + C)) * 4
    assert row["denoise_flops"] == pytest.approx(want)
    assert row["achieved_flops_per_s"] > 0 and row["achieved_bytes_per_s"] > 0
    assert row["mode"].startswith("fixed-work") and row["prompt_source"] == "random-token-ids"
    assert "random token ids" in row["workload_warning"]
    prov = row["provenance"]
    for key in ("device_name", "dtype", "torch", "triton", "git_commit", "model_name", "model_parameters",
                "settings", "seed", "prompt_set_hash", "timestamp", "kernels"):
        assert key in prov
    assert prov["metadata"] == {"k": "v"} and prov["label"] == "t" and prov["dtype"] == "float32"
    assert doc["card"]["parameters"]["total"] == prov["model_parameters"]


def test_printers_render_the_same_record(doc):
    rows = doc["rows"]
    row = rows[0]
    # jsonl: the row itself.
    assert json.loads(report.to_jsonl(rows)) == row
    # csv: every flattened scalar, same value.
    parsed = next(csv.DictReader(io.StringIO(report.to_csv(rows, skip=metrics.NOT_IN_CSV))))
    flat = report.flatten(row, skip=metrics.NOT_IN_CSV)
    assert set(parsed) == set(flat)
    for k, v in flat.items():
        if v is None:
            assert parsed[k] == ""
        elif isinstance(v, (dict, list)):
            assert parsed[k] == report.fmt(v)
        elif isinstance(v, float):
            assert float(parsed[k]) == v, k
        else:
            assert parsed[k] == str(v), k
    # md: every figure with its formatted value and its definition.
    md = report.to_markdown(rows, headline=["output_throughput"], definitions=metrics.DEFINITIONS, title="R",
                            skip=metrics.NOT_IN_CSV)
    lines = {ln.split("|")[1].strip(): ln for ln in md.splitlines() if ln.startswith("| `")}
    for k, v in row.items():
        if k in ("provenance", "steps_histogram", "label", "runs_detail"):
            continue
        assert f"| {report.cell(k, v)} |" in lines[f"`{k}`"], k
        assert metrics.DEFINITIONS.get(k, "") in lines[f"`{k}`"]
    assert "3 steps |" in md and "git_commit" in md


def test_cli_formats_md_csv_jsonl(ckpt):
    base = ["--model", str(ckpt), *FIXED, "--runs", "1", "--warmup", "0"]
    md = run(*base, "--verbose").stdout
    assert md.index("# dgemma bench") < md.index("## Results") < md.index("### Figures") < md.index("### Provenance")
    assert json.loads(md.strip().splitlines()[-1])["max_denoising_steps"] == 3  # one JSON line last
    csv_out = run(*base, "--format", "csv").stdout
    assert csv_out.splitlines()[0].startswith("label,kind,") and len(csv_out.splitlines()) == 2
    line = json.loads(run(*base, "--format", "jsonl").stdout)
    assert line["diffusion_steps_per_canvas"] == 3


def test_default_md_is_short_with_units_and_the_rest_behind_verbose(ckpt):
    """Issue 23: the default human output was 187 lines for one row (raw byte counts, every figure): now the
    card and the main figures with units; every figure (and each definition) is one flag away, and the
    machine formats keep every field."""
    base = ["--model", str(ckpt), *FIXED, "--runs", "1", "--warmup", "0"]
    md, full = run(*base).stdout, run(*base, "--verbose").stdout
    assert len(md.splitlines()) <= 50 < len(full.splitlines()), md
    assert "### Figures" not in md and "### Provenance" not in md and "add --verbose" in md
    figures = {ln.split("|")[1].strip(" `"): ln.split("|")[2].strip() for ln in md.splitlines() if ln.startswith("| `")}
    # Batch size 1: no slot occupancy; --no-measure-peaks: no roofline ratio.
    assert list(figures) == [k for k in metrics.SUMMARY if k not in ("slot_occupancy", "step_vs_floor",
                                                                    *metrics.IMAGE_FIGURES)]
    assert figures["output_throughput"].endswith(" tok/s") and figures["mean_step_ms"].endswith(" ms")
    assert re.fullmatch(r"[\d.]+ ([KMG]i)?B", figures["peak_memory_bytes"]) and figures["quality"] == "n/a"
    assert figures["cap_hit_rate"] == "100 %"  # fixed work: every block runs the cap
    # The queue wait at batch 1 is the backlog of a pass that submits every prompt at once: said so.
    queue = next(ln for ln in md.splitlines() if ln.startswith("| `mean_queue_ms`"))
    assert "all 2 prompts of a run are submitted at once" in queue
    assert "submits all its prompts at once" in metrics.DEFINITIONS["mean_queue_ms"]
    card = md[: md.index("## Results")]
    assert re.search(r"\d [KMG]iB", card) and "FLOP" in card and not re.search(r"\d{1,3}(,\d{3}){2,}", card)  # no raw byte counts
    assert json.loads(md.strip().splitlines()[-1]).keys() == json.loads(full.strip().splitlines()[-1]).keys()


def test_save_result(ckpt, tmp_path):
    run("--model", str(ckpt), *FIXED, "--runs", "1", "--warmup", "0", "--save-result", "--result-dir",
        str(tmp_path), "--result-filename", "r.json", "--format", "jsonl")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved) == {"card", "definitions", "rows"} and saved["rows"][0]["runs"] == 1


def test_dummy_config_fixed_work_in_every_row(ckpt):
    r = run("--dummy", str(ckpt / "config.json"), "--layers", "1", "--diffusion-steps", "2", "--runs", "1",
            "--warmup", "0", "--num-prompts", "1", "--random-input-len", "6", "--confidence-threshold", "0.5",
            "--no-measure-peaks", "--format", "jsonl")
    row = json.loads(r.stdout)
    assert row["dummy_weights"] and "dummy" in row["mode"] and row["confidence_threshold"] == 0
    assert row["ignore_eos"] and row["cap_hit_rate"] == 1 and row["provenance"]["dummy_weights"]
    assert "WARNING: prompts are random token ids" in r.stderr and "ignored" in r.stderr


def test_dummy_layers_keep_the_pattern():
    raw, _, name = dummy_config("26B-A4B", layers=7)
    types = raw["text_config"]["layer_types"]
    assert types == [S] * 5 + [F, F] and raw["text_config"]["num_hidden_layers"] == 7 and "7 layers" in name
    assert dummy_config("26B-A4B", layers=4)[0]["text_config"]["layer_types"] == [S, S, S, F]


def test_peaks_give_the_roofline_columns(ckpt, monkeypatch):
    monkeypatch.setattr(b, "device_peaks", lambda dev, measure_cpu=True, compute="bfloat16": info.Peaks(
        "fake", 1e12, 1e11, "test", compute=compute))
    row = json.loads(run("--model", str(ckpt), *FIXED, "--runs", "1", "--warmup", "0", "--format", "jsonl").stdout)
    # held to the peak of the matmul the run uses: its model dtype's (no GGML weights here)
    assert row["peak_compute"] == row["provenance"]["dtype"] in ("float32", "bfloat16")
    floor = max(row["denoise_flops"] / 1e12, row["denoise_bytes"] / 1e11)
    assert row["floor_step_ms"] == pytest.approx(floor / row["diffusion_denoising_steps"] * 1e3)
    assert row["step_vs_floor"] == pytest.approx(row["mean_step_ms"] / row["floor_step_ms"])
    assert row["flops_utilization"] == pytest.approx(row["achieved_flops_per_s"] / 1e12)
    assert row["floor_bound"] in ("compute", "memory") and row["peaks_source"] == "test"


def test_ctrl_c_keeps_finished_runs(ckpt, monkeypatch):
    calls = {"n": 0}
    real = request.run_batch

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # warm-up + run 1 (every prompt at once) done; the second run is cut
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(request, "run_batch", flaky)
    r = run("--model", str(ckpt), *FIXED, "--runs", "3", "--warmup", "1", "--format", "jsonl", code=130)
    row = json.loads(r.stdout)
    assert row["runs"] == 1 and row["completed"] == 2 and "1 of 3" in row["interrupted"]


def test_bad_input_is_one_line(ckpt, tmp_path):
    from dgcli.cli import app

    cases = [["--format", "xml"], ["--model", str(ckpt), "--prompts", str(tmp_path / "none.jsonl")],
             ["--model", str(ckpt), "--layers", "2"], ["--model", str(ckpt), "--dummy", "26B-A4B"],
             ["--dummy", "26B-A4B", "--layers", "0"], ["--json", "--json-schema", str(ckpt / "config.json")],
             ["--json", "--base-url", "http://127.0.0.1:9"], ["--json", "--ignore-eos"]]
    for args in cases:
        r = CliRunner().invoke(app, ["bench", *args])
        assert isinstance(r.exception, UserError) and "\n" not in str(r.exception), (args, r.exception)


def test_dummy_preflight_refuses_what_cannot_fit():
    from dgcli.checkpoint.random_weights import make_config
    from dgcli.checkpoint.config import parse_config

    raw, _, _ = dummy_config("26B-A4B")
    huge = parse_config({**raw, "text_config": {**raw["text_config"], "num_experts": 128 * 64}})  # ~1.5 T params
    with pytest.raises(UserError, match=r"needs ~\d+.*GiB.*--layers"):
        session.preflight(huge, 2, torch.device("cpu"), spec="huge")
    session.preflight(parse_config(make_config(TEXT, canvas_length=C)), 4, torch.device("cpu"), spec="tiny")


def test_prompt_file_encodes_with_the_chat_template(ckpt, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "The quick brown fox", "answer": "x"}\n\n{"prompt": "jumps over"}\n')
    row = json.loads(run("--model", str(ckpt), "--prompts", str(f), "--diffusion-steps", "2", "--runs", "1",
                         "--warmup", "0", "--no-measure-peaks", "--format", "jsonl").stdout)
    assert row["prompt_source"] == f"file:{f}" and row["num_prompts"] == 2 and "workload_warning" not in row
    assert row["mode"] == "adaptive" and row["mean_input_len"] > 4


def test_a_schema_draws_every_answer_and_the_row_says_which(tmp_path):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 4}}, "required": ["word"]}
    (tmp_path / "word.json").write_text(json.dumps(schema))
    (tmp_path / "p.jsonl").write_text('{"prompt": "Reverse: c a t", "answer": "t a c"}\n{"prompt": "Sort: 3 1"}\n')
    base = ["--prompts", str(tmp_path / "p.jsonl"), "--runs", "1", "--warmup", "0", "--no-measure-peaks", "-f", "jsonl"]
    free, shaped, whole = (json.loads(run(*base, *more).stdout) for more in (
        [], ["--json-schema", str(tmp_path / "word.json")], ["--json"]))  # the bundled model
    assert free["exact_match"] == 1 and free["json_valid_rate"] is None and "json_schema" not in free["provenance"]
    assert shaped["json_valid_rate"] == whole["json_valid_rate"] == 1 and shaped["exact_match"] == 0
    digest = hashlib.sha256(json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert shaped["provenance"]["json_schema"] == {"name": "word.json", "sha256": digest}
    assert whole["provenance"]["json_schema"]["name"] == "any object"


# ---- the figures' arithmetic on hand-made requests -------------------------------------------------------


def _req(steps, *, tokens=5, finish="stop", prefix=8):
    t = {"prefill_s": 0.01, "denoise_s": 0.001 * sum(steps), "commit_s": 0.002 * (len(steps) - 1),
         "first_block_s": 0.01 + 0.001 * steps[0], "total_s": 0.011 + 0.001 * sum(steps) + 0.002 * (len(steps) - 1)}
    done = Done(token_ids=list(range(tokens)), finish_reason=finish, stop_id=1, blocks=len(steps),
                steps_per_block=list(steps), decoder_passes=sum(steps), tokens_per_forward=tokens / sum(steps),
                timings=t)
    return Response([0] * prefix, done.token_ids, finish, done, None, [prefix + i * C for i in range(len(steps))])


def sequential(responses: list[Response]) -> metrics.Pass:
    """A pass of requests run one after another, each alone (batch size 1, no wait), from their own timings."""
    d = [r.done for r in responses]
    steps = sum(sum(x.steps_per_block) for x in d)
    return metrics.Pass(list(responses), sum(x.timings["total_s"] for x in d), 1, steps, steps,
                        sum(x.timings["denoise_s"] for x in d), [0.0] * len(d),
                        [x.timings["first_block_s"] for x in d], [x.timings["total_s"] for x in d])


def test_summary_of_a_bimodal_step_distribution():
    from dgcli.checkpoint.random_weights import make_config
    from dgcli.checkpoint.config import parse_config

    cfg = parse_config(make_config(TEXT, canvas_length=C))
    runs = [sequential([_req([48, 12]), _req([9])]),
            sequential([_req([48]), _req([10, 48, 11], tokens=40, finish="length")])]
    row = metrics.summarize(runs, cfg, 48, weight_bytes=4, peaks=None)
    steps = [48, 12, 9, 48, 10, 48, 11]
    assert row["steps_histogram"] == {"9": 1, "10": 1, "11": 1, "12": 1, "48": 3}
    assert row["cap_hit_rate"] == pytest.approx(3 / 7)
    assert row["cap_steps_share"] == pytest.approx(144 / sum(steps))  # the cap blocks' share of all steps
    assert row["cap_hit_rate_first_block"] == pytest.approx(2 / 4)
    assert row["p50_steps_per_block"] == 12  # sorted: 9 10 11 12 48 48 48
    assert row["p90_steps_per_block"] == 48 and row["p99_steps_per_block"] == 48
    assert row["diffusion_steps_per_canvas"] == pytest.approx(sum(steps) / 7)
    assert row["mean_blocks_per_request"] == 7 / 4 and row["finish_length_rate"] == 1 / 4
    assert row["total_output_tokens"] == 55
    assert row["mean_step_ms"] == pytest.approx(1.0) and row["mean_commit_ms"] == pytest.approx(2.0)
    # Throughput per run, then the mean over runs.
    t1 = 10 / (0.011 * 2 + 0.001 * 69 + 0.002)
    t2 = 45 / (0.011 * 2 + 0.001 * 117 + 0.004)
    assert row["output_throughput"] == pytest.approx((t1 + t2) / 2)
    assert metrics.stat([1, 2, 3, 4], 50, 1.0) == 2.5 and metrics.stat([5], 99, 1.0) == 5


def test_warm_up_meets_every_shape_of_a_timed_pass_when_steps_are_captured(monkeypatch):
    """With a captured step (`--cuda-graphs`: session.step_mode != "dynamic") the warm-up runs every prompt
    once (the timed pass's cache and batch sizes, so a timed pass captures nothing); else `--warmup` requests."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(b.request, "run_batch", lambda s, ids, **kw: seen.append((len(ids), kw["batch_size"])) or [])
    prompts = [SimpleNamespace(ids=[i]) for i in range(5)]
    for mode, want in (("dynamic", (1, 4)), ("graphs", (5, 4))):
        seen.clear()
        b.warm_up(SimpleNamespace(step_mode=mode), prompts, None, 1, batch_size=4, ignore_eos=False)
        assert seen == [want]
    seen.clear()
    b.warm_up(SimpleNamespace(step_mode="graphs"), prompts, None, 0, batch_size=4, ignore_eos=False)
    assert seen == []  # --warmup 0 is no warm-up
