"""`generate --check-determinism` (PRODUCT.md, "Beyond the peers"): the prompts run again, as before and batched the
other way, and every step's decisions compared; a difference is exit 1 naming where it first appeared."""

import pytest
from cli_run import run

from dgcli.runtime import request
from dgcli.runtime.determinism import Record, first_difference

FAST = ["--diffusion-steps", "4", "--blocks", "2"]


def test_one_prompt_is_checked_alone_and_beside_a_batch_mate(cli_ckpt, capsys):
    code, out, err = run(["generate", "--model", str(cli_ckpt), *FAST, "--check-determinism", "hi"], capsys)
    assert code == 0, err
    line = next(x for x in err.splitlines() if "determinism" in x)
    assert "the same in 2 more runs (again at batch size 1; each beside a batch-mate (batch size 2))" in line
    assert out.strip()  # the answer is printed as without the check


def test_rows_run_batched_are_checked_alone(cli_ckpt, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n{"prompt": "c d e"}\n{"prompt": "f", "seed": 9}\n')
    code, out, err = run(["generate", "--model", str(cli_ckpt), *FAST, "--input-jsonl", str(f), "--batch-size", "3",
                          "--check-determinism", "--dtype", "bfloat16", "--format", "json"], capsys)
    assert code == 0 and len(out.splitlines()) == 3, err  # the three answers, as without the check
    assert "(again at batch size 3; each alone)" in err and "entropies equal bits" in err  # bf16 on CPU: bits


def test_a_run_that_decides_otherwise_fails_with_where(cli_ckpt, capsys, monkeypatch):
    """A fault that only the batched re-run has (its seeds shifted) must be found and named: exit 1."""
    real = request.run_batch

    def shifted(session, prompts, *, batch_size, seeds=None, **kw):
        if batch_size > 1:
            seeds = [s + 7 for s in seeds]
        return real(session, prompts, batch_size=batch_size, seeds=seeds, **kw)

    monkeypatch.setattr(request, "run_batch", shifted)
    code, _, err = run(["generate", "--model", str(cli_ckpt), *FAST, "--check-determinism", "hi"], capsys)
    assert code == 1
    line = next(x for x in err.splitlines() if "determinism" in x)
    assert "FAILED" in line and "each beside a batch-mate (batch size 2), request 1: block 1 step 1:" in line


def test_first_difference_names_the_step_and_the_decision():
    step = (0, 1, None, {"canvas_in": [1, 2], "argmax": [3, 4], "sample": [3, 5], "accepted_mask": [True, False],
                         "next_canvas": [3, 9]})
    a = Record(steps=[step], answer=([3, 4], "length"))
    assert first_difference(a, Record(steps=[step], answer=([3, 4], "length"))) is None
    other = (0, 1, None, {**step[3], "accepted_mask": [True, True]})
    assert first_difference(a, Record(steps=[other])) == "block 1 step 1: accepted_mask differs at 1 position(s)"
    assert first_difference(a, Record(steps=[step], answer=([3], "stop"))) == "the answers differ"
    assert first_difference(a, Record(steps=[step, step], answer=a.answer)) == "1 steps against 2"


def test_it_is_refused_with_ray(capsys):
    code, out, err = run(["generate", "--check-determinism", "--ray", "local", "--input-jsonl", "x.jsonl"], capsys)
    assert code == 2 and out == "" and "--check-determinism runs here, not on a cluster: drop --ray" in err


@pytest.mark.parametrize("flag", ["--check-determinism"])
def test_help_lists_it(capsys, flag):
    code, out, _ = run(["generate", "--help"], capsys)
    assert code == 0 and flag in out
