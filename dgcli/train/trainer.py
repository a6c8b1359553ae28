"""Trains the bundled tiny DiffusionGemma on CPU: `python -m dgcli.train --out DIR --minutes M --seed S`.

Owns: the training objective (spec Appendix A), the optimiser and schedule, batching of chat turns into
[prefix | canvas] rows, periodic held-out evaluation with the real sampler, and writing the checkpoint
(weights in the released layout, tokenizer, generation_config.json, `training.json` with the recipe,
hyper-parameters, wall time, curves and final metrics). Must not: define model math (dgcli.model.gemma) or
data (dgcli.train.tasks), or change the sampler.

Objective, per example: pick one answer block k uniformly; prefix = chat-templated prompt + the clean
answer blocks before k; draw t ~ U(0.001, 1] and replace each canvas position by a uniform random id
with probability t; loss = mean CE over all C canvas positions against the clean block (pads and
`<turn|>` included: that is how the model learns where an answer ends) + `enc_loss` x causal-LM CE of
the prefix rows (encoder mode). Self-conditioning: with probability `sc_prob` per batch, a first pass
without grad gives logits, divided by a per-row temperature ~ U[0.4, 0.8] (the sampler's range) and fed
back through `model.soft_embedding`, exactly as inference feeds the previous step; otherwise the soft
embedding is zero, as on the sampler's first step (HF inference, not the JAX port's zero logits).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dgcli.train import tasks
from dgcli.checkpoint.random_weights import REFERENCE_GENERATION_CONFIG, make_config, random_model, write_checkpoint
from dgcli.model.gemma import DiffusionGemma
from dgcli.text.tokenizer import ChatTokenizer, load_tokenizer
from dgcli.text.build import build_tokenizer, write_tokenizer_files

S, F_ = "sliding_attention", "full_attention"
DEFAULT_WEIGHTS = {"reverse": 0.27, "sort": 0.27, "count": 0.36, "text": 0.10}  # the shipped model's mix


def text_config(a: argparse.Namespace) -> dict:
    # Sliding window > any training or eval sequence: both layer kinds see everything, but the
    # checkpoint still exercises both geometries (head dims, K=V full layers, proportional RoPE).
    types = [S] * (a.layers - 1) + [F_]
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                moe_intermediate_size=a.moe_inter, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                num_key_value_heads=a.kv_heads, num_global_key_value_heads=1, head_dim=a.head_dim,
                global_head_dim=2 * a.head_dim, num_experts=a.experts, top_k_experts=a.top_k,
                sliding_window=512, layer_types=types, max_position_embeddings=4096)


@torch.no_grad()
def init_weights_(model: DiffusionGemma, seed: int) -> None:
    """Matrices ~ N(0, 1/fan_in); every gain, scale and layer scalar 1 (a trainable start, unlike the
    random U(0.5, 1.5) gains of dummy checkpoints)."""
    g = torch.Generator().manual_seed(seed)
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.ndim >= 2:
            t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1]))
        else:
            t.fill_(1.0)


class Batcher:
    """Training rows: left-padded prefixes (with a validity mask) and their clean target canvases."""

    def __init__(self, tok: ChatTokenizer, canvas: int, seed: int, weights: dict[str, float], verses: list[str],
                 count_min: int = 8):
        self.tok, self.c = tok, canvas
        self.stream = tasks.training_stream(seed, weights, verses, count_min)
        self.rng = random.Random(seed + 1)
        self._prompt_cache: dict[str, list[int]] = {}

    def prompt_ids(self, prompt: str) -> list[int]:
        ids = self._prompt_cache.get(prompt)
        if ids is None:
            ids = self.tok.encode_prompt(prompt)
            if len(self._prompt_cache) < 200_000:
                self._prompt_cache[prompt] = ids
        return ids

    def next(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        prefixes, targets = [], []
        for _ in range(batch):
            ex = next(self.stream)
            blocks = tasks.answer_blocks(self.tok.encode_text(ex.answer), self.c, self.tok.turn_end_id, self.tok.pad_id)
            k = self.rng.randrange(len(blocks))
            prefixes.append(self.prompt_ids(ex.prompt) + [i for b in blocks[:k] for i in b])
            targets.append(blocks[k])
        p = max(map(len, prefixes))
        ids = torch.full((batch, p), self.tok.pad_id, dtype=torch.long)
        valid = torch.zeros((batch, p), dtype=torch.bool)
        for r, pre in enumerate(prefixes):  # left padding: every row's canvas starts right after its prefix
            ids[r, p - len(pre):] = torch.tensor(pre)
            valid[r, p - len(pre):] = True
        return ids, valid, torch.tensor(targets)


def loss_fn(model: DiffusionGemma, prefix: torch.Tensor, valid: torch.Tensor, target: torch.Tensor,
            gen: torch.Generator, sc: bool, enc_weight: float, bf16: bool = True) -> tuple[torch.Tensor, dict]:
    b, c = target.shape
    v = model.config.vocab_size
    t = torch.rand(b, 1, generator=gen) * 0.999 + 0.001  # [B, 1] corruption rate in (0.001, 1]
    noise = torch.randint(0, v, target.shape, generator=gen)
    noisy = torch.where(torch.rand(b, c, generator=gen) < t, noise, target)  # [B, C]
    soft = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if sc:
            with torch.no_grad():
                first = model.logits(model.unified_hidden(prefix, noisy, None, valid)[1])  # [B, C, V]
                temp = torch.rand(b, 1, 1, generator=gen) * 0.4 + 0.4
                soft = model.soft_embedding(first / temp)
        ph, ch = model.unified_hidden(prefix, noisy, soft, valid)
        logits = model.logits(ch)  # [B, C, V] fp32
        diff = F.cross_entropy(logits.reshape(-1, v), target.reshape(-1))
        loss = diff
        enc = torch.zeros(())
        if enc_weight > 0:
            pl = model.logits(ph[:, :-1])  # [B, P-1, V]
            tgt = prefix[:, 1:].masked_fill(~(valid[:, 1:] & valid[:, :-1]), -100)
            enc = F.cross_entropy(pl.reshape(-1, v), tgt.reshape(-1), ignore_index=-100)
            loss = diff + enc_weight * enc
    with torch.no_grad():
        pred = logits.argmax(-1)
        tok_acc = (pred == target).float().mean().item()
        block_acc = (pred == target).all(-1).float().mean().item()
    return loss, {"diff": diff.item(), "enc": enc.detach().item(), "tok_acc": tok_acc, "block_acc": block_acc}


# ---- evaluation with the real sampler -----------------------------------------------------------
def evaluate(model: DiffusionGemma, tok: ChatTokenizer, examples: list[tasks.Example], *, num_blocks: int = 4,
             params=None, stop_ids=None, keep_outputs: bool = False) -> dict:
    """Exact match and steps per block per family, generating with `dgcli.engine.generate`."""
    from dgcli.engine import generate
    from dgcli.sampling.params import DiffusionEbParams

    params = params or DiffusionEbParams()
    stop_ids = stop_ids if stop_ids is not None else [tok.eos_id, tok.turn_end_id]
    fams: dict[str, dict] = {}
    outputs = []
    for ex in examples:
        done = generate(model, tok.encode_prompt(ex.prompt), params=params, num_blocks=num_blocks,
                        stop_ids=stop_ids, pad_id=tok.pad_id)
        text = tok.answer_text(done.token_ids)
        f = fams.setdefault(ex.family, {"n": 0, "correct": 0, "steps": [], "stopped": 0})
        f["n"] += 1
        f["correct"] += int(ex.answer is not None and tasks.check_answer(text, ex.answer))
        f["steps"] += list(done.steps_per_block)
        f["stopped"] += int(done.finish_reason == "stop")
        if keep_outputs:
            outputs.append({"prompt": ex.prompt, "family": ex.family, "answer": ex.answer, "output": text,
                            "steps_per_block": list(done.steps_per_block)})
    return summarize(fams, params.max_denoising_steps) | ({"outputs": outputs} if keep_outputs else {})


def summarize(fams: dict, cap: int) -> dict:
    out: dict = {"families": {}}
    all_steps: list[int] = []
    correct = n = 0
    for name, f in fams.items():
        all_steps += f["steps"]
        row = {"n": f["n"], "mean_steps_per_block": sum(f["steps"]) / max(1, len(f["steps"])),
               "cap_hit_rate": sum(s >= cap for s in f["steps"]) / max(1, len(f["steps"])),
               "stop_rate": f["stopped"] / f["n"]}
        if name != tasks.TEXT_FAMILY:
            row["exact_match"] = f["correct"] / f["n"]
            correct, n = correct + f["correct"], n + f["n"]
        out["families"][name] = row
    out["exact_match"] = correct / max(1, n)
    out["mean_steps_per_block"] = sum(all_steps) / max(1, len(all_steps))
    return out


def save(model: DiffusionGemma, out: Path, cfg_dict: dict, dtype: torch.dtype, gen_cfg: dict) -> None:
    m = copy.deepcopy(model).to(dtype)
    for layer in m.layers:  # layer scalars stay fp32, as in the released checkpoint
        layer.layer_scalar.data = layer.layer_scalar.float()
        layer.encoder_layer_scalar.data = layer.encoder_layer_scalar.float()
    write_checkpoint(m, out, cfg_dict, generation_config=gen_cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgcli.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=50.0, help="wall-clock cap; training stops there")
    ap.add_argument("--steps", type=int, default=20000, help="schedule length (cosine ends here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=160)
    ap.add_argument("--inter", type=int, default=320)
    ap.add_argument("--moe-inter", type=int, default=160)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=40)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--canvas", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--sc-prob", type=float, default=0.5)
    ap.add_argument("--enc-loss", type=float, default=0.5)
    ap.add_argument("--eval-every-min", type=float, default=12.0)
    ap.add_argument("--eval-per-family", type=int, default=8)
    # One thread: on a shared 2-core machine two OpenMP threads stall whenever another process runs
    # (measured 0.6-28 s per step with 2 threads vs a steady 1.1-1.3 s with 1).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--count-min", type=int, default=8,
                    help="shortest training count (held-out counts have 8-40 numbers; fewer teaches the end)")
    ap.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_WEIGHTS.items()),
                    help="family=weight,... sampling weights of the training mixture")
    # bf16 autocast measured slower than fp32 at hidden 128-192 (the casts outweigh AMX gains).
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32")
    a = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_log.jsonl", "w")

    verses = tasks.load_verses()
    tok_raw = build_tokenizer(tasks.tokenizer_corpus(a.seed, 100_000, verses), a.vocab)
    write_tokenizer_files(tok_raw, out)
    tok = load_tokenizer(out)
    cfg_dict = make_config(text_config(a), canvas_length=a.canvas, dtype=a.save_dtype)
    model = random_model(cfg_dict, seed=a.seed, dtype=torch.float32)
    init_weights_(model, a.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    gen_cfg = dict(REFERENCE_GENERATION_CONFIG, max_new_tokens=4 * a.canvas)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.98))
    mix = {k: float(v) for k, v in (kv.split("=") for kv in a.mix.split(","))}
    batcher = Batcher(tok, a.canvas, a.seed, mix, verses, a.count_min)
    gen = torch.Generator().manual_seed(a.seed)
    coin = random.Random(a.seed + 2)
    evalset = tasks.heldout_set(a.seed + 100, a.eval_per_family)

    def lr_at(step: int) -> float:
        # Cosine over whichever runs out first, steps or wall time: on a shared machine the step
        # rate varies with other load, and the schedule must still end at the deadline.
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        by_steps = (step - a.warmup) / max(1, a.steps - a.warmup)
        frac = min(1.0, max(by_steps, (time.time() - t_start) / deadline))
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    deadline = a.minutes * 60
    curve = []
    train_s = 0.0
    next_eval = a.eval_every_min * 60
    step = 0
    ema: dict[str, float] = {}
    print(f"params {n_params/1e6:.2f} M; tokenizer {tok.vocab_size}; setup {time.time()-t_start:.1f}s", flush=True)

    def run_eval(tag: str) -> dict:
        model.eval()
        t0 = time.time()
        with torch.no_grad():
            res = evaluate(model, tok, evalset, num_blocks=3)
        model.train()
        res.update(step=step, train_minutes=train_s / 60, eval_s=time.time() - t0, tag=tag)
        curve.append(res)
        log.write(json.dumps({"eval": res}) + "\n")
        log.flush()
        fam = " ".join(f"{k}={v.get('exact_match', 0):.2f}/{v['mean_steps_per_block']:.1f}" for k, v in res["families"].items())
        print(f"EVAL step {step} train_min {train_s/60:.1f}: em {res['exact_match']:.3f} steps/blk "
              f"{res['mean_steps_per_block']:.1f} [{fam}] ({res['eval_s']:.0f}s)", flush=True)
        ckpt = out / f"ckpt_step{step}"  # a complete checkpoint, so the curve can be re-measured later
        save(model, ckpt, cfg_dict, torch.float32, gen_cfg)
        write_tokenizer_files(tok_raw, ckpt)
        return res

    while step < a.steps and time.time() - t_start < deadline:
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        prefix, valid, target = batcher.next(a.batch)
        loss, m = loss_fn(model, prefix, valid, target, gen, coin.random() < a.sc_prob, a.enc_loss, a.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        step += 1
        train_s += time.time() - t0
        for k, v in m.items():
            ema[k] = v if k not in ema else 0.98 * ema[k] + 0.02 * v
        if step % 50 == 0:
            rec = {"step": step, "train_s": round(train_s, 1), "lr": lr_at(step), "gnorm": gnorm,
                   "ex_per_s": step * a.batch / train_s, **{k: round(v, 4) for k, v in ema.items()}}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
        if time.time() - t_start >= next_eval:
            run_eval("periodic")
            next_eval += a.eval_every_min * 60

    final = run_eval("final")
    save(model, out, cfg_dict, getattr(torch, a.save_dtype), gen_cfg)
    wall = time.time() - t_start
    info = {
        "command": " ".join([sys.executable.split("/")[-1], "-m", "dgcli.train", *(argv or sys.argv[1:])]),
        "hyperparameters": vars(a), "parameters": n_params, "steps": step, "train_seconds": train_s,
        "wall_seconds": wall, "examples_seen": step * a.batch, "final_metrics": final, "curve": curve,
        "recipe": {
            "families": mix, "heldout_rule": f"sha1(prompt) % 100 < {tasks.HELDOUT_PERCENT} is held out",
            "english_text": tasks.TEXT_PACKAGE, "objective": __doc__.split("\n\n", 2)[2].strip(),
            "end_of_answer": "answer ids, <turn|> (106), then <pad> (0) to the end of the canvas",
        },
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": a.threads,
                    "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / "training.json").write_text(json.dumps(info, indent=2))
    print(f"done: {step} steps, wall {wall/60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
