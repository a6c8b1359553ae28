"""`/metrics` of a real `dgemma serve` (bundled model) after requests from the real `openai` client: time to
first token and end-to-end request latency as Prometheus histograms (vLLM's names under our `dgemma_` prefix),
whose `_bucket` series count every finished request."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from server_proc import serve

NAMES = ("dgemma_time_to_first_token_seconds", "dgemma_e2e_request_latency_seconds")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve("--max-batch-size", "2", tmp_path=tmp_path_factory.mktemp("serve")) as s:
        yield s


def histogram(text: str, name: str) -> tuple[list[tuple[float, int]], float, int]:
    """(buckets as (le, count) in order, sum, count) of histogram `name` in Prometheus text."""
    assert f"# TYPE {name} histogram" in text and f"# HELP {name} " in text, text
    buckets = [(float(le), int(n)) for le, n in re.findall(rf'^{name}_bucket\{{le="([^"]+)"\}} (\d+)$', text, re.M)]
    total = float(re.search(rf"^{name}_sum (\S+)$", text, re.M).group(1))
    count = int(re.search(rf"^{name}_count (\d+)$", text, re.M).group(1))
    return buckets, total, count


def test_latency_histograms_count_every_finished_request(server):
    client = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=60)
    before = {n: histogram(httpx.get(server.base_url + "/metrics").text, n)[2] for n in NAMES}
    assert before == dict.fromkeys(NAMES, 0)
    for prompt in ("Reverse: c a t", "Count from 7 to 31."):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}])
    for chunk in client.chat.completions.create(model="tiny", stream=True,
                                                messages=[{"role": "user", "content": "Sort: 7 2 9 2"}]):
        pass
    text = httpx.get(server.base_url + "/metrics").text
    (ttft, ttft_sum, ttft_n), (e2e, e2e_sum, e2e_n) = (histogram(text, n) for n in NAMES)
    assert ttft_n == e2e_n == 3
    for buckets, n in ((ttft, ttft_n), (e2e, e2e_n)):
        counts = [c for _, c in buckets]
        assert buckets[-1] == (float("inf"), n) and counts == sorted(counts) and len(buckets) > 10
        assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
    assert 0 < ttft_sum <= e2e_sum < 60  # the first block comes no later than the answer's end
