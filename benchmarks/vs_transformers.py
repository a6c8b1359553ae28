"""transformers' `DiffusionGemmaForBlockDiffusion.generate` against dgemma on the same checkpoint, prompts
and fixed-work settings, alternating, in one process; prints the ratio of their times with its spread.

Fixed work on both sides: every block runs all `--steps` steps (dgemma: confidence_threshold 0;
transformers rejects 0, so it gets 1e-30, which random weights' mean entropy never undercuts) and stop
ids are off (both would otherwise stop at random ids of random weights). The script checks that both
ran the same number of decoder passes (transformers' are counted by wrapping its forward). Each round
runs every prompt through both, the order flipping every round so that drift in machine load (this
machine is shared) hits both alike; the ratio is taken per round, then its median and range are shown.

    python benchmarks/vs_transformers.py [--checkpoint DIR | --config small|medium] [--rounds 7]
        [--prompts 2] [--prompt-len 32] [--steps 8] [--blocks 2] [--threads 1] [--dtype float32]

Without --checkpoint a random checkpoint of the named config is written to a temporary folder first.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import CONFIG_200M, DUMMY_MEDIUM, cpu_name, emit, median, parser, spread, wall

S, F = "sliding_attention", "full_attention"
CONFIGS = {
    "small": (dict(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1,
                   head_dim=32, global_head_dim=64, num_experts=8, top_k_experts=2, sliding_window=128,
                   layer_types=[S, S, S, F], max_position_embeddings=4096), 64),
    "medium": (json.loads(DUMMY_MEDIUM.read_text())["text_config"], 256),
    "200m": (json.loads(CONFIG_200M.read_text())["text_config"], 256),  # bf16's end-to-end figure (--dtype bfloat16)
}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--checkpoint", help="checkpoint directory (default: write a random one of --config)")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="small")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.checkpoint, a.config, a.rounds, a.prompts, a.prompt_len, a.steps, a.blocks = None, "small", 1, 1, 8, 2, 1
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)

    import dgcli
    from dgcli.checkpoint.random_weights import write_random_checkpoint
    from dgcli.engine import generate
    from dgcli.sampling.params import DiffusionEbParams
    from dgcli.measure.printers import git_commit, kernel_choices
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (DiffusionGemmaGenerationConfig,
                                                                                EntropyBoundSamplerConfig)

    tmp = None
    path = a.checkpoint
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        text, canvas = CONFIGS[a.config]
        path = str(write_random_checkpoint(Path(tmp.name) / "ckpt", text, canvas_length=canvas, dtype=dtype,
                                           tokenizer=False))
    hf_logging.set_verbosity_error()  # the random checkpoint has no vision tower: transformers lists it as missing
    session = dgcli.open_session(path, settings={"device": "cpu", "dtype": a.dtype}, need_tokenizer=False)
    ours, packed = session.model, session.packed_weights  # as a session runs it (weights packed or not)
    torch.set_num_threads(a.threads)  # --threads, not the session's thread rule
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # fixed work: no stop ids (see the docstring)
    cfg = ours.config
    c = cfg.canvas_length

    passes = {"hf": 0}
    forward = hf.forward

    def counted(*args, **kw):  # transformers' generate calls self.forward once per decoder pass
        passes["hf"] += 1
        return forward(*args, **kw)

    hf.forward = counted
    params = DiffusionEbParams(max_denoising_steps=a.steps, confidence_threshold=0.0, seed=0)
    gen_cfg = DiffusionGemmaGenerationConfig(
        max_new_tokens=a.blocks * c, max_denoising_steps=a.steps, t_min=params.t_min, t_max=params.t_max,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=params.entropy_bound),
        stability_threshold=params.stability_threshold, confidence_threshold=1e-30, eos_token_id=None, pad_token_id=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (1, a.prompt_len), generator=g) for _ in range(a.prompts)]

    def run_hf(ids) -> float:
        before = passes["hf"]
        with torch.no_grad():
            dt, _ = wall(lambda: hf.generate(ids, generation_config=gen_cfg))
        assert passes["hf"] - before == a.blocks * a.steps, "transformers did not run fixed work"
        return dt

    def run_ours(ids) -> float:
        dt, done = wall(lambda: generate(ours, ids, params=params, num_blocks=a.blocks))
        assert done.decoder_passes == a.blocks * a.steps and done.blocks == a.blocks, "dgemma did not run fixed work"
        return dt

    run_hf(prompts[0]), run_ours(prompts[0])  # warm-up, untimed
    ratios, t_hf, t_ours = [], [], []
    for r in range(a.rounds):
        first, second = (run_hf, run_ours) if r % 2 == 0 else (run_ours, run_hf)
        times = {run_hf: 0.0, run_ours: 0.0}
        for ids in prompts:
            times[first] += first(ids)
            times[second] += second(ids)
        t_hf.append(times[run_hf])
        t_ours.append(times[run_ours])
        ratios.append(times[run_hf] / times[run_ours])
        print(f"round {r + 1}: transformers {times[run_hf]:.3f} s, dgemma {times[run_ours]:.3f} s, "
              f"ratio {ratios[-1]:.3f}", file=sys.stderr)

    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    sp = spread(ratios)
    result = {
        "what": "time(transformers generate) / time(dgemma generate), same checkpoint/prompts/fixed work",
        "ratio_median": statistics.median(ratios), "ratio_min": sp["min"], "ratio_max": sp["max"],
        "ratio_q1": q[0], "ratio_q3": q[2], "rounds": a.rounds,
        "transformers_s_per_round_median": median(t_hf), "dgemma_s_per_round_median": median(t_ours),
        "decoder_passes_per_request": a.blocks * a.steps, "prompts": a.prompts, "prompt_len": a.prompt_len,
        "canvas": c, "blocks": a.blocks, "steps": a.steps, "config": a.checkpoint or a.config, "dtype": a.dtype,
        "threads": a.threads, "parameters": sum(p.numel() for p in ours.parameters()),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "dgemma_kernels": kernel_choices(torch.device("cpu"), packed), "git_commit": git_commit(),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} thread(s)",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"transformers / dgemma time ratio: median {result['ratio_median']:.3f} "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}, range {min(ratios):.3f}-{max(ratios):.3f}) over {a.rounds} rounds")
    emit(result)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
