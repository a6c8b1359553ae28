"""Printers of the one bench/sweep record (md, csv, json, jsonl) and of the info card, plus provenance's parts.

One record, many printers (llama-bench): every printer renders the same row dicts, so a figure has the same key
and value in every format; md adds each figure's definition. Owns: number formatting, the card's text, the git
commit, device name and kernel choices of a row's provenance, `--metadata k=v` parsing and saving a result file
atomically. Must not: measure, run models, or decide what a figure means (metrics.py does).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

from dgcli.errors import UserError
from dgcli.measure.cost.memory import size
from dgcli.measure.peaks import COMPUTE

REPO = Path(__file__).resolve().parents[2]


# ---- provenance --------------------------------------------------------------------------------------------


def git_commit() -> str:
    """HEAD of the checkout dgemma runs from (+ '-dirty' with local changes), or 'unknown'."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def device_name(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    from dgcli.measure.peaks import cpu_label

    return cpu_label()


def kernel_choices(device: Any, packed_weights: int = 0, ggml: str | None = None,
                   dtype: str | None = None) -> dict[str, str]:
    """Which implementation each op ran (kernels/dispatch.py::provenance), the paged attention's backend and, for
    GGML weights, `ggml_activations` (int8 or the activations' dtype: dgcli/model/ggml.py::activation_path)."""
    import torch

    from dgcli.kernels.dispatch import provenance
    from dgcli.model.attention import backend

    out = {**provenance(device, dtype, packed=bool(packed_weights)), "attention": backend(torch.device(device))}
    if ggml is None:
        return out
    if ggml == "nvfp4":  # NVFP4 weights (kernels/nvfp4.py): activations never FP4; int8 in the CPU's C, else bf16
        from dgcli.kernels.dispatch import nvfp4_provenance

        impl = nvfp4_provenance(device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        return {**out, "linear": impl, "experts": impl}
    # GGML weights: their linears and experts run kernels/ggml_cpu.py (int8: the C int8 kernel; else torch's)
    ggml_impl = "ggml, c-int8" if ggml == "int8" else "ggml, torch-ops"
    return {**out, "linear": ggml_impl, "experts": ggml_impl, "ggml_activations": ggml}


def parse_metadata(items: Iterable[str]) -> dict[str, str]:
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--metadata {item!r}: use KEY=VALUE")
        out[key.strip()] = value
    return out


# ---- numbers ------------------------------------------------------------------------------------------------


def _si(n: float) -> tuple[float, str]:
    """The SI scale of n (1, 1e3 ... 1e15) and its prefix."""
    i = 0
    while abs(n) >= 1000 ** (i + 1) and i < 5:
        i += 1
    return 1000.0**i, " KMGTP"[i].strip()


def human(n: float | None, unit: str = "") -> str:
    """SI prefixes, 4 significant digits: 1.5 GFLOP (bytes in binary units: `size`)."""
    if n is None:
        return "-"
    scale, prefix = _si(float(n))
    return f"{n / scale:.4g} {prefix}{unit}".rstrip()


def count(n: float) -> str:
    """Parameter counts the way model cards write them: 25.25 B, 3.84 B, 12.6 M."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.4g} {suffix}"
    return str(int(n))


# Figures that are null when they do not apply (no reference answers): text printers say so.
NOT_APPLICABLE = ("quality", "exact_match", "quality_metric")


def cell(key: str, v: Any) -> str:
    """`fmt`, except that a figure of NOT_APPLICABLE without a value reads n/a, not '-'."""
    return "n/a" if v is None and key in NOT_APPLICABLE else fmt(v)


def fmt(v: Any) -> str:
    """One cell: ints with no decimals, floats to 4 significant digits, dicts as k:v lists."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.4e}"
    if isinstance(v, dict):  # an interval inside (spread) reads [min, max]
        return ";".join(f"{k}:" + (f"[{', '.join(fmt(y) for y in x)}]" if isinstance(x, list) else fmt(x))
                        for k, x in v.items())
    if isinstance(v, list):
        return ";".join(fmt(x) for x in v)
    return str(v)


# ---- flat printers -------------------------------------------------------------------------------------------


def flatten(row: dict, skip: Iterable[str] = ()) -> dict[str, Any]:
    """Nested dicts become dotted keys (provenance.device_name); the histogram stays one cell."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k in skip:
            continue
        if isinstance(v, dict) and k != "steps_histogram":
            for k2, v2 in flatten(v).items():
                out[f"{k}.{k2}"] = v2
        else:
            out[k] = v
    return out


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def to_csv(rows: list[dict], skip: Iterable[str] = ()) -> str:
    flat = [flatten(r, skip) for r in rows]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    cols = _columns(flat)
    w.writerow(cols)
    for r in flat:
        w.writerow(["" if r.get(c) is None else fmt(r[c]) if isinstance(r.get(c), (dict, list)) else r[c] for c in cols])
    return buf.getvalue()


def to_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in rows)


def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=2, default=str) + "\n"


def headline_json(rows: list[dict], keys: list[str]) -> str:
    """The one JSON line printed last, for scripts: the headline figures of each row."""
    pick = [{k: r.get(k) for k in keys if k in r} for r in rows]
    return json.dumps(pick[0] if len(pick) == 1 else pick, separators=(",", ":"), default=str)


def varying_keys(rows: list[dict], keys: Iterable[str]) -> list[str]:
    return [k for k in keys if len({json.dumps(r.get(k), sort_keys=True, default=str) for r in rows}) > 1]


def md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(lines)


def histogram_text(hist: dict[str, int], width: int = 40) -> str:
    if not hist:
        return "(no blocks)"
    top = max(hist.values())
    kw = max(len(k) for k in hist)
    return "\n".join(f"{k:>{kw}} steps | {'#' * max(1, round(width * v / top))} {v}" for k, v in hist.items())


def row_names(rows: list[dict]) -> list[str]:
    """Column names of the md tables: the label (else `row N`), and the batch size when rows differ by it."""
    sizes = {r.get("batch_size") for r in rows}
    out = []
    for i, r in enumerate(rows):
        name = str(r.get("label") or ("" if len(sizes) > 1 else f"row {i + 1}"))
        out.append(f"{name} batch {r.get('batch_size')}".strip() if len(sizes) > 1 else name)
    return out


def to_markdown(rows: list[dict], *, headline: list[str], definitions: dict[str, str], title: str,
                skip: Iterable[str] = ()) -> str:
    """A headline table (one line per row), then every figure with each row's value and its definition,
    the step histogram(s), and the provenance (shared values once, varying ones per row)."""
    names = row_names(rows)
    out = [f"## {title}", "", md_table(["label"] + headline, [[n] + [cell(k, r.get(k)) for k in headline]
                                                               for n, r in zip(names, rows)])]
    skip = set(skip) | {"provenance", "steps_histogram", "label"}
    keys = [k for k in _columns(rows) if k not in skip and not isinstance(rows[0].get(k), (list,))]
    body = [[f"`{k}`"] + [cell(k, r.get(k)) for r in rows] + [definitions.get(k, "")] for k in keys]
    out += ["", "### Figures (each with its definition)", "", md_table(["figure"] + names + ["definition"], body)]
    for n, r in zip(names, rows):
        if r.get("steps_histogram"):
            out += ["", f"### Denoising steps per block: {n}", "", "```", histogram_text(r["steps_histogram"]), "```"]
    provs = [flatten(r.get("provenance") or {}) for r in rows]
    if provs and provs[0]:
        cols = _columns(provs)
        varying = varying_keys(provs, cols)
        out += ["", "### Provenance", ""] + [f"- {k}: {fmt(provs[0].get(k))}" for k in cols if k not in varying]
        out += [f"- {k}: " + ", ".join(f"{n}={fmt(p.get(k))}" for n, p in zip(names, provs)) for k in varying]
    return "\n".join(out) + "\n"


# ---- the card ------------------------------------------------------------------------------------------------


def card_markdown(card: dict) -> str:
    p, m, cfg = card["parameters"], card["memory"], card["config"]
    lines = [f"## {card['model']}", "", f"source: {card['source']}", ""]
    lines += [f"- {k}: {v}" for k, v in cfg.items()]
    parts = ", ".join(f"{k} {count(v)}" for k, v in p.items() if k not in ("total", "active_per_token"))
    lines += ["", f"**parameters** (text): total **{count(p['total'])}** ({p['total']:,}), "
              f"active per token **{count(p['active_per_token'])}** ({p['active_per_token']:,})",
              f"  by part: {parts}",
              "**bytes by dtype** (" + card["bytes_source"] + "): "
              + ", ".join(f"{k} {size(v)}" for k, v in card["bytes_by_dtype"].items())]
    if card.get("vision"):
        v = card["vision"]
        lines.append(f"vision tower: {count(v['parameters'])} parameters, {v['note']}")
    lines += ["", f"**memory to run** ({card['dtype']}, KV for {m['kv_context']:,} tokens):",
              f"- weights {size(m['weights'])}",
              f"- KV cache {size(m['kv_cache'])} (sliding layers keep a ring of their window; the "
              f"context's positions in every layer would be {size(m['kv_cache_every_position'])}, "
              f"{size(m['kv_per_token'])}/token)",
              f"- one request's sampler state and its largest pass's temporaries (computed as in the batch memory "
              f"below): {size(m['one_request']['cuda'])} on CUDA (CUDA graphs' copy included), "
              f"{size(m['one_request']['cpu'])} on CPU",
              f"- total ~**{size(m['total']['cuda'])}** on CUDA, ~{size(m['total']['cpu'])} on CPU", ""]
    s, c, pf = card["per_step"], card["per_commit"], card["prefill"]
    lines += [f"**per denoising step** (prompt {card['prompt_len']} tokens): {human(s['flops'], 'FLOP')}, "
              f"{human(s['bytes'], 'B')} moved at least (first step {human(s['first_step_flops'], 'FLOP')}, "
              f"last {human(s['last_step_flops'], 'FLOP')}; {s['distinct_experts']:.1f} distinct experts per layer)",
              f"**per commit** (encode one block): {human(c['flops'], 'FLOP')}, {human(c['bytes'], 'B')}; "
              f"**prefill**: {human(pf['flops'], 'FLOP')}, {human(pf['bytes'], 'B')}"]
    if card.get("threads"):
        lines += [f"**threads**: {card['threads']['count']} ({card['threads']['source']})"]
    if card["devices"]:
        body = [[d["name"], f"{peak_text(d, 'flops', 'FLOP/s')} {COMPUTE[d.get('compute', 'bfloat16')]}",
                 peak_text(d, "bytes", "B/s"), f"{d['floor_step_ms']:.4g} ms ({d['floor_step_bound']})",
                 f"{d['floor_commit_ms']:.4g} ms ({d['floor_commit_bound']})",
                 f"{d['ceiling_canvas_tokens_per_s']:.4g}", d["source"]] for d in card["devices"]]
        lines += ["", "**theoretical floor** (roofline: max(FLOPs/peak, bytes/bandwidth)):", "",
                  md_table(["device", "peak matmul", "bandwidth", "floor / step", "floor / commit",
                            "canvas tok/s ceiling (1 step/block)", "peaks source"], body)]
    lines += ["", f"_{card['conventions']}_"]
    return "\n".join(lines) + "\n"


def peak_text(d: dict, what: str, unit: str) -> str:
    """A peak (`what`: flops or bytes of a card's device or a Peaks as a dict) with, when it was measured, the
    min-max of its probes in the median's unit: "95.2 GFLOP/s (88.1-97.3 over 5 probes)"."""
    value, rng = d[f"{what}_per_s"], d.get(f"{what}_range")
    scale = _si(value)[0]
    return human(value, unit) + (f" ({rng[0] / scale:.3g}-{rng[1] / scale:.3g} over {d.get('repeats')} probes)"
                                 if rng else "")


# ---- files ---------------------------------------------------------------------------------------------------


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def check_result_place(result_dir: str | None, filename: str | None) -> None:
    """Before anything is measured: the result's folder exists (made if need be) and takes files, and a named
    file is not a folder, so a long run never ends unsaved."""
    d = Path(result_dir or ".")
    path = d / filename if filename else None
    if d.exists() and not d.is_dir():
        raise UserError(f"--result-dir {d} is a file; name a folder")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--result-dir {d}: cannot make the folder ({e.strerror}); pick a writable folder") from None
    if path is not None and path.is_dir():
        raise UserError(f"--result-filename {filename}: {path} is a folder; name a file")
    folder = path.parent if path is not None else d
    flag = "--result-filename" if folder != d else "--result-dir"
    try:  # permission bits do not tell for root, /proc or a read-only mount: a file must really appear there
        import tempfile

        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        why = "no such folder" if not folder.is_dir() else e.strerror
        raise UserError(f"{flag}: cannot write in {folder} ({why}); pick a writable folder") from None


def save_result(doc: dict, result_dir: str | None, filename: str | None, label: str | None) -> Path:
    d = Path(result_dir or ".")
    name = filename or f"dgemma-bench-{(label + '-') if label else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = d / name
    try:
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(path, to_json(doc))
    except OSError as e:
        raise UserError(f"{path}: cannot write the result ({e.strerror}); pick a writable --result-dir") from None
    return path
