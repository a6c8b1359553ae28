"""The short human output of `dgemma bench` (its default): the card in a screenful, the main figures of each row
in one table with their units and a short meaning, and where the rest is (--verbose: printers.to_markdown).
Must not: measure, or decide what a figure means (metrics.py: DEFINITIONS and SUMMARY do).
"""

from __future__ import annotations

from typing import Any

from dgcli.measure.metrics import unit
from dgcli.measure.peaks import COMPUTE
from dgcli.measure.printers import cell, count, fmt, human, md_table, peak_text, row_names, size

MORE = "Every figure with its definition, the step histogram and provenance: add --verbose (or --format json)."


def _ms(ms: float) -> str:
    """A time the way one reads it: µs below 0.1 ms, else ms, 4 significant digits."""
    return f"{ms * 1e3:.4g} µs" if ms < 0.1 else f"{ms:.4g} ms"


def _measured(name: str, how: str = "measured") -> str:
    """A device name marked as measured here: "AMD EPYC (1 thread)" -> "AMD EPYC (1 thread, measured)"."""
    return name[:-1] + f", {how})" if name.endswith(")") else name + f" ({how})"


def card_text(card: dict) -> str:
    """The card in ~15 lines: architecture, parameters, memory to run, cost of a step, threads, roofline."""
    cfg, p, m, s = card["config"], card["parameters"], card["memory"], card["per_step"]
    kv, hd = cfg["kv_heads"], cfg["head_dim"]
    lines = [f"## {card['model']}", "", f"source: {card['source']}", "",
             f"- architecture: {cfg['layers']}; hidden {cfg['hidden_size']}, {cfg['attention_heads']} heads (KV "
             f"{kv['sliding']} sliding, {kv['full']} full; head dim {hd['sliding']}/{hd['full']}), vocab "
             f"{cfg['vocab_size']:,}",
             f"- experts: {cfg['experts']}; dense MLP {cfg['dense_mlp']}; canvas {cfg['canvas_length']} tokens",
             f"- parameters: {count(p['total'])} ({count(p['active_per_token'])} active per token); weights "
             + ", ".join(f"{k} {size(v)}" for k, v in card["bytes_by_dtype"].items()),
             f"- memory to run ({card['dtype']}, KV for {m['kv_context']:,} tokens): ~{size(m['total']['cpu'])} on CPU "
             f"= weights {size(m['weights'])} + KV cache {size(m['kv_cache'])} + one request's passes "
             f"~{size(m['one_request']['cpu'])} (CUDA ~{size(m['total']['cuda'])})",
             f"- per denoising step (prompt {card['prompt_len']} tokens): {human(s['flops'], 'FLOP')}, "
             f"{human(s['bytes'], 'B')} moved at least; per commit {human(card['per_commit']['flops'], 'FLOP')}; "
             f"prefill {human(card['prefill']['flops'], 'FLOP')}"]
    if card.get("vision"):
        lines.append(f"- vision tower: {count(card['vision']['parameters'])} parameters, {card['vision']['note']}")
    if card.get("threads"):
        lines.append(f"- **threads**: {card['threads']['count']} ({card['threads']['source']})")
    if card["devices"]:
        body = [[_measured(d["name"], "pinned" if str(d.get("source")).startswith("pinned") else "measured")
                 if d.get("flops_range") else d["name"],
                 f"{peak_text(d, 'flops', 'FLOP/s')} {COMPUTE[d.get('compute', 'bfloat16')]}",
                 peak_text(d, "bytes", "B/s"), f"{_ms(d['floor_step_ms'])} ({d['floor_step_bound']})",
                 human(d["ceiling_canvas_tokens_per_s"], "tok/s")] for d in card["devices"]]
        lines += ["", "Roofline floor per denoising step, max(FLOPs / peak, bytes / bandwidth):", "",
                  md_table(["device", "peak matmul", "bandwidth", "floor / step", "canvas ceiling (1 step/block)"],
                           body)]
    return "\n".join(lines) + "\n"


def value(key: str, v: Any, definitions: dict[str, str]) -> str:
    """One figure with its unit: bytes in KiB/MiB/GiB, shares as %, the rest as printers.fmt with the unit."""
    u = unit(key, definitions)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return cell(key, v)
    if u == "B":
        return size(v)
    if key.endswith("_rate") or key in ("slot_occupancy",):
        return f"{v * 100:.3g} %"
    if key == "step_vs_floor":
        return f"{fmt(float(v))}x"
    return f"{fmt(v)} {u}".strip()


def settings_line(rows: list[dict]) -> str:
    """What was run, once: the settings every row shares."""
    r = rows[0]
    src = str(r.get("prompt_source", "")).rsplit("/", 1)[-1]
    sizes = sorted({x.get("batch_size", 1) for x in rows})
    return (f"{r.get('mode')} · steps ≤ {r.get('max_denoising_steps')} · {r.get('blocks')} block(s) at most · "
            f"batch size {', '.join(map(str, sizes))} · {r.get('num_prompts')} prompts ({src}) x {r.get('runs')} "
            f"timed run(s), every prompt of a run submitted at once")


def rows_text(rows: list[dict], *, summary: dict[str, str], definitions: dict[str, str], title: str) -> str:
    """The main figures (`summary`: key -> short meaning, in order) of every row as one table, figure per
    line, each with its unit and meaning; then where the rest is."""
    names = row_names(rows)
    batched = any(r.get("batch_size", 1) > 1 for r in rows)
    keys = [k for k in summary if any(k in r for r in rows) and (batched or k != "slot_occupancy")]
    n = rows[0].get("num_prompts")

    def meaning(k: str) -> str:
        return summary[k].replace("{num_prompts}", str(n))

    body = [[f"`{k}`"] + [value(k, r.get(k), definitions) for r in rows] + [meaning(k)] for k in keys]
    out = [f"## {title}", "", settings_line(rows), "", md_table(["figure"] + names + ["meaning"], body), "", MORE]
    return "\n".join(out) + "\n"
