"""Prefix caching on this CPU: requests that share a long system prompt, with and without the cache.

Model: benchmarks/dummy-medium.json cut to --layers (default 2: sliding + full), random bf16 weights, fixed
work (confidence threshold 0, --steps steps a block), 1 thread unless --threads. Workload: a --system-len
token system prompt (default 1,500) shared by --requests requests (default 6), each with its own 40-token
question, run one after another through one engine (2 slots; each request submitted when the previous one
finished, as chat turns arrive), so request 1 fills the cache and requests 2.. find the system prompt there.
Per mode (prefix caching on, then off: `--no-prefix-caching` beside it): each request's time to first block
(submit to its first block's commit, the engine's clock) and prefill time, the later requests' median TTFB
over the first's, the hit rate (prompt tokens found / looked up), and whether the answers are equal: to the run
without caching, and to a run without caching whose prompts are encoded in two chunks split where the hit ends
(random bf16 weights make near-ties everywhere, so the chunking alone can flip a token; see the test
tests/model/test_prefix_blocks.py for the bit-level statement).
Prints one JSON line per mode, then a summary line.
"""

from __future__ import annotations

import json
import random

import torch

from dgcli.checkpoint.random_weights import random_model
from dgcli.engine import LLMEngine as Engine, Request
from dgcli.sampling.events import Done
from dgcli.sampling.params import DiffusionEbParams
from harness import DUMMY_MEDIUM, emit, median, parser, wall


def model_of(layers: int):
    cfg = json.loads(DUMMY_MEDIUM.read_text())
    t = cfg["text_config"]
    t["layer_types"] = t["layer_types"][:layers - 1] + ["full_attention"]
    t["num_hidden_layers"] = layers
    return random_model(cfg, dtype=torch.bfloat16)


def run(model, prompts: list[list[int]], params, blocks: int, prefix_caching: bool, **kw) -> dict:
    c = model.config.canvas_length
    stats: dict = {}
    engine = Engine(model, slots=2, max_len=max(map(len, prompts)) + blocks * c, stats=stats,
                    prefix_caching=prefix_caching, **kw)
    rows = []

    def serve():  # one request after another, as chat turns arrive
        for i, ids in enumerate(prompts):
            engine.submit(Request(id=i, prompt=torch.tensor(ids), params=params, num_blocks=blocks, seed=i))
            done = [ev for ev in engine.events() if isinstance(ev, Done)][0]
            rows.append({"ttfb_s": done.timings["first_block_s"], "prefill_s": done.timings["prefill_s"],
                         "answer": done.token_ids})
    seconds, _ = wall(serve)
    first, later = rows[0]["ttfb_s"], [r["ttfb_s"] for r in rows[1:]]
    return {"prefix_caching": prefix_caching, "wall_s": seconds,
            "ttfb_s": [round(r["ttfb_s"], 3) for r in rows], "prefill_s": [round(r["prefill_s"], 3) for r in rows],
            "later_over_first": median(later) / first if later else None,
            "hit_rate": stats["prefix_cache_hits"] / stats["prefix_cache_queries"] if prefix_caching else None,
            "prefill_tokens": stats["prefill_tokens"], "answers": [r["answer"] for r in rows]}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--system-len", type=int, default=1500)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="denoising steps a block (fixed work)")
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.dry_run:
        a.layers, a.system_len, a.requests, a.steps = 2, 40, 2, 1
    torch.set_num_threads(a.threads)
    model = model_of(a.layers)
    g = random.Random(0)
    v = model.config.vocab_size
    system = [2] + [g.randrange(3, v) for _ in range(a.system_len - 1)]
    prompts = [system + [g.randrange(3, v) for _ in range(40)] for _ in range(a.requests)]
    params = DiffusionEbParams(max_denoising_steps=a.steps, confidence_threshold=0.0)
    with torch.inference_mode():
        run(model, prompts[:1], params, a.blocks, True)  # warm-up (one request, untimed)
        got = [run(model, prompts, params, a.blocks, on) for on in (True, False)]
        # The control: caching off, every prompt encoded in two chunks split where the hit ends (a pass budget
        # of the hit's length): the chunking a hit gives. bf16 answers equal this bit for bit on CPU.
        hit = a.system_len // 16 * 16
        split = run(model, prompts, params, a.blocks, False, budget=hit)
    for r in got:
        emit({k: v for k, v in r.items() if k != "answers"})
    on, off = got
    emit({"layers": a.layers, "system_len": a.system_len, "requests": a.requests, "steps": a.steps,
                      "threads": a.threads, "answers_equal": on["answers"] == off["answers"],
                      "first_answer_equal": on["answers"][0] == off["answers"][0],  # no hit: encoded whole in both
                      "later_answers_equal_to_off_chunked_at_the_hit": on["answers"][1:] == split["answers"][1:],
                      "later_ttfb_over_first_on": round(on["later_over_first"], 3),
                      "later_ttfb_over_first_off": round(off["later_over_first"], 3),
                      "hit_rate": round(on["hit_rate"], 3)})


if __name__ == "__main__":
    main()
