"""A 3-turn chat through the `openai` client against `dgemma serve` (bundled model): each turn resends the
earlier turns, the server finds them in its prefix cache (/metrics counts the tokens), and every answer equals
a `--no-prefix-caching` server's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from cli_run import run
from server_proc import serve

SYSTEM = ("You are a careful assistant. Answer each task exactly, with the items separated by spaces, and "
          "nothing else. Tasks are reversing, sorting and counting.")
TURNS = ["Reverse: c a t", "Sort: 7 2 9 2", "Count from 3 to 11."]


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {k: float(v) for k, _, v in (line.partition(" ") for line in text.splitlines())
            if k.startswith("dgemma_prefix_cache_")}


def conversation(server) -> tuple[list[str], dict[str, float]]:
    client = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=60)
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        got = client.chat.completions.create(model="tiny", messages=messages, seed=0)
        answers.append(got.choices[0].message.content)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers, metrics(server.base_url)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(a server with prefix caching, one with --no-prefix-caching), one slot each."""
    tmp = tmp_path_factory.mktemp("prefix")
    with serve("--max-batch-size", "1", tmp_path=tmp) as on, \
            serve("--max-batch-size", "1", "--no-prefix-caching", tmp_path=tmp) as off:
        yield on, off
        logs = on.log() + off.log()
    assert "Traceback" not in logs, logs


def test_a_three_turn_chat_hits_the_cache_and_answers_as_without_it(servers):
    on, off = servers
    with_cache, counts = conversation(on)
    without, off_counts = conversation(off)
    assert with_cache == without and all(with_cache)
    queries, hits = counts["dgemma_prefix_cache_queries_total"], counts["dgemma_prefix_cache_hits_total"]
    # turns 2 and 3 find at least the system prompt's and turn 1's whole blocks; turn 1 finds nothing
    assert queries > 0 and 0.3 * queries < hits < queries and hits % 16 == 0
    assert off_counts == {"dgemma_prefix_cache_queries_total": 0, "dgemma_prefix_cache_hits_total": 0}


def test_remote_bench_reads_the_hit_rate_from_metrics(servers, tmp_path, capsys):
    """`dgemma bench --base-url` against `dgemma serve`: prompts that share a long opening find it in the server's
    cache (from the second request on); the row's hit rate is the server's counters over the timed pass."""
    on, off = servers
    opening = "Read the task below and answer it exactly, with the items separated by single spaces. "
    prompts = tmp_path / "shared.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": opening + t}) + "\n" for t in TURNS))
    common = ["bench", "--prompts", str(prompts), "--runs", "1", "--warmup", "0", "--format", "json"]
    before = metrics(on.base_url)
    code, out, err = run([*common, "--base-url", on.v1], capsys)
    assert code == 0, err
    rate = json.loads(out)["rows"][0]["prefix_cache_hit_rate"]
    after = metrics(on.base_url)
    queries, hits = (after[k] - before[k] for k in ("dgemma_prefix_cache_queries_total", "dgemma_prefix_cache_hits_total"))
    assert rate == hits / queries and 0.2 < rate < 1
    code, out, err = run([*common, "--base-url", off.v1], capsys)
    assert code == 0, err
    assert json.loads(out)["rows"][0]["prefix_cache_hit_rate"] is None  # counters at 0: nothing looked up
