"""Quality of the bundled tiny model: exact match per family and denoising steps per block, for
dgemma's sampler and for transformers' `DiffusionGemmaForBlockDiffusion.generate` on the same
checkpoint and held-out prompts, both with the reference sampler defaults (48-step cap).

    python benchmarks/eval_bundled.py [--model DIR] [--prompts FILE] [--impl dgemma,transformers]

Prints one table row per (implementation, family), the free-text outputs, then one JSON line last.
Owns: this comparison only. Must not: train or change the model.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

from dgcli.checkpoint.load import load_generation_config
from dgcli.runtime.settings import from_generation_config, stop_ids_from_generation_config
from dgcli.sampling.params import DiffusionEbParams
from dgcli.text.tokenizer import load_tokenizer
from dgcli.train import tasks
from dgcli.train.trainer import evaluate, summarize
from harness import ROOT, cpu_name, emit, parser

BUNDLED = ROOT / "dgcli" / "data" / "tiny"
PROMPTS = ROOT / "dgcli" / "data" / "prompts" / "heldout.jsonl"


class StepCounter:
    """A transformers streamer that counts denoising steps per block (one put_draft per step, one put per
    block after the initial put of the prompt)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._n = 0
        self._puts = 0

    def put_draft(self, value=None, logits=None) -> None:
        self._n += 1

    def put(self, value) -> None:
        self._puts += 1
        if self._puts > 1:
            self.steps.append(self._n)
            self._n = 0

    def end(self) -> None:
        pass


def eval_transformers(model_dir: Path, tok, examples: list[tasks.Example], params: DiffusionEbParams,
                      num_blocks: int, stop_ids: list[int], canvas: int) -> dict:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=torch.float32).eval()
    gc = DiffusionGemmaGenerationConfig(
        max_new_tokens=num_blocks * canvas, max_denoising_steps=params.max_denoising_steps,
        sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": params.entropy_bound},
        t_min=params.t_min, t_max=params.t_max, stability_threshold=params.stability_threshold,
        confidence_threshold=params.confidence_threshold, eos_token_id=stop_ids, pad_token_id=tok.pad_id)
    fams: dict[str, dict] = {}
    outputs = []
    for i, ex in enumerate(examples):
        torch.manual_seed(params.seed + i)  # transformers draws from the global generator
        prompt = torch.tensor([tok.encode_prompt(ex.prompt)])
        counter = StepCounter()
        with torch.no_grad():
            out = ref.generate(input_ids=prompt, generation_config=gc, streamer=counter)
        new = out.sequences[0, prompt.shape[1]:].tolist()
        text = tok.answer_text(new)
        f = fams.setdefault(ex.family, {"n": 0, "correct": 0, "steps": [], "stopped": 0})
        f["n"] += 1
        f["correct"] += int(ex.answer is not None and tasks.check_answer(text, ex.answer))
        f["steps"] += counter.steps
        f["stopped"] += int(any(t in stop_ids for t in new))
        outputs.append({"prompt": ex.prompt, "family": ex.family, "answer": ex.answer, "output": text,
                        "steps_per_block": counter.steps})
    return summarize(fams, params.max_denoising_steps) | {"outputs": outputs}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--impl", default="dgemma,transformers")
    ap.add_argument("--blocks", type=int, default=4, help="block cap (generation stops at <turn|> before it)")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts per family (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="dgemma's dtype (bf16: a GGUF's int8 path)")
    ap.add_argument("--out", default="", help="also write the full result (with outputs) as JSON here")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.limit, a.blocks = 1, 1
    torch.set_num_threads(a.threads)

    model_dir = Path(a.model)
    if model_dir.suffix == ".gguf":  # a GGUF file (e.g. `dgemma quantize dgcli/data/tiny F.gguf --type q8_0`)
        from dgcli.checkpoint.gguf_model import load_gguf_tokenizer

        tok = load_gguf_tokenizer(model_dir)
    else:
        tok = load_tokenizer(model_dir)
    raw_gen = load_generation_config(model_dir) or {}
    params = DiffusionEbParams.from_dict({k: v for k, v in from_generation_config(raw_gen).items()
                                          if k != "max_tokens"}).replace(seed=a.seed)
    if a.dry_run:
        params = params.replace(max_denoising_steps=4)
    stop_ids = stop_ids_from_generation_config(raw_gen) or [tok.eos_id, tok.turn_end_id]
    examples = tasks.read_prompt_file(a.prompts)
    if a.limit:
        kept, per = [], {}
        for e in examples:
            per[e.family] = per.get(e.family, 0) + 1
            if per[e.family] <= a.limit:
                kept.append(e)
        examples = kept

    results = {}
    for impl in a.impl.split(","):
        t0 = time.perf_counter()  # the implementation's whole evaluation, load included
        if impl == "dgemma":
            import dgcli

            dtype = "float32" if a.dtype == "fp32" else "bfloat16"  # the model as a session runs it
            model = dgcli.open_session(model_dir, settings={"device": "cpu", "dtype": dtype}).model
            torch.set_num_threads(a.threads)  # --threads, not the session's thread rule
            with torch.no_grad():
                res = evaluate(model, tok, examples, num_blocks=a.blocks, params=params, stop_ids=stop_ids,
                               keep_outputs=True)
        elif impl == "transformers":
            res = eval_transformers(model_dir, tok, examples, params, a.blocks, stop_ids,
                                    json.loads((model_dir / "config.json").read_text())["canvas_length"])
        else:
            raise SystemExit(f"--impl {impl}: expected dgemma or transformers")
        res["seconds"] = time.perf_counter() - t0
        results[impl] = res

    print(f"{'impl':13} {'family':8} {'n':>4} {'exact':>6} {'steps/blk':>9} {'cap-hit':>7} {'stop':>5}")
    for impl, res in results.items():
        for fam, row in res["families"].items():
            em = f"{row['exact_match']:.3f}" if "exact_match" in row else "  -  "
            print(f"{impl:13} {fam:8} {row['n']:4d} {em:>6} {row['mean_steps_per_block']:9.2f} "
                  f"{row['cap_hit_rate']:7.2f} {row['stop_rate']:5.2f}")
        print(f"{impl:13} {'ALL':8} {'':4} {res['exact_match']:6.3f} {res['mean_steps_per_block']:9.2f}   "
              f"({res['seconds']:.0f} s)")
    for impl, res in results.items():
        for o in res["outputs"]:
            if o["answer"] is None:
                print(f"[{impl}] {o['prompt']!r} -> {o['output']!r}")
    summary = {
        "model": str(model_dir), "prompts": str(a.prompts), "n_prompts": len(examples), "seed": a.seed, "block_cap": a.blocks,
        "settings": vars(params) if hasattr(params, "__dict__") else str(params),
        "machine": cpu_name(), "threads": a.threads, "dtype": a.dtype,
        "torch": torch.__version__,
        "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": {impl: {k: v for k, v in r.items() if k != "outputs"} for impl, r in results.items()},
    }
    if a.out:
        Path(a.out).write_text(json.dumps(summary | {"outputs": {i: r["outputs"] for i, r in results.items()}}, indent=2))
    emit(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
