"""Compile every Triton kernel of kernels/ ahead of time for sm_90 (H100/H200) and sm_80 (A100), on a machine
without a GPU, and check what the interpreter cannot see: the cubin builds, shared memory fits the block limit,
the tensor cores are used where the kernel means to use them, and nothing spills to local memory.

Owns: `configs()` (every configuration the launch wrappers can launch on CUDA, at the real model's shapes, as
plain JSON-able dicts), `compile_configs` (compiles them in a child process without TRITON_INTERPRET: the
kernel modules turn into interpreted functions when it is set at import), `problems` (the checks) and the
report table (`python benchmarks/kernel_targets.py`). Must not: launch anything or need a GPU or driver.

The constexprs are those the wrappers pass on CUDA (kernels/moe.py, kernels/vocab_pass.py: DOT_BF16 on for
bf16, not the interpreter's value), the argument types those of the tensors they pass, and integer or pointer
arguments carry Triton's divisible-by-16 specialization when the real values have it. Batch size changes
only grids and the row count N (a multiple of the 256-row canvas, so always divisible by 16): one compile
covers every batch bucket. Shared memory is the compiled kernel's (the launch adds none: no dynamic shared
memory of its own). Spills: ptxas's stack frame (cuobjdump's STACK) and local memory (LOCAL), which is
where ptxas puts spilled registers; the Triton kernels here hold no local arrays.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, emit, parser, wall  # noqa: E402

# target -> (compute capability, shared memory per block in bytes (opt-in maximum), tensor-core PTX mnemonic)
TARGETS = {"sm_90": (90, 232_448, "wgmma"), "sm_80": (80, 166_912, "mma.sync")}
TC_ANY = re.compile(r"\b(wgmma|mma)\.")  # any tensor-core instruction in PTX
H, V, I, E, TOPK = 2816, 262_144, 704, 128, 8  # hidden, vocabulary, expert width, experts, experts per token
HEAD_DIMS = (256, 512)  # sliding and full attention heads (q/k/v norms)
CANVAS = 256
FP8 = "fp8e4nv"  # torch.float8_e4m3fn
DT = {"bf16": "bf16", "fp32": "fp32"}
# Accepted spills (bytes of stack frame per thread) and why. The stats kernel keeps five per-row running
# statistics beside the [64, 64] logits tile at 255 registers and spills a few of them (16-72 B measured,
# outside the GEMM, the most for fp32 on sm_80, with the bf16(L) scratch store); 8 warps would remove it but
# change the in-tile reduction order, so the GPU's bits.
SPILL_EXCEPTIONS = {"vocab_pass._stats_kernel": 80}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def spec(kernel: str, label: str, target: str, args: dict, constexprs: dict, tensor_core: bool,
         options: dict | None = None, spill_ok: int = 0) -> dict:
    """One configuration. args: name -> '*dtype' (a tensor), an int (i32/i64 by value) or a float (fp32);
    options: the launch's num_warps / num_stages when not Triton's defaults; spill_ok: bytes of stack frame
    per thread accepted (a stated exception, see SPILL_EXCEPTIONS)."""
    return dict(kernel=kernel, label=label, target=target, args=args, constexprs=constexprs, tensor_core=tensor_core,
                options=options or {}, spill_ok=spill_ok)


def _rmsnorm(target: str) -> list[dict]:
    out = []
    for dt in DT:
        e = "*" + dt
        for h in (H, *HEAD_DIMS):
            for weight, adds in ((True, False), (False, False), (True, True)):  # adds: residual, pre-add, scale
                args = dict(x_ptr=e, w_ptr=e, out_ptr=e, pre_ptr=e, res_ptr=e, s_ptr="*fp32", n_cols=h, stride_x=h,
                            stride_o=h, eps=1e-6)
                block = 1 << (h - 1).bit_length()
                out.append(spec("fused._rms_norm_kernel", f"{dt} H={h}{' w' if weight else ''}{' +' if adds else ''}",
                                target, args, dict(HAS_WEIGHT=weight, HAS_PRE=adds, HAS_RES=adds, HAS_SCALE=adds,
                                                   IS_BF16=dt == "bf16", BLOCK=block), False))
        for d, nq, nkv, has_v in ((HEAD_DIMS[0], 16, 8, 1), (HEAD_DIMS[-1], 16, 2, 0)):  # sliding, full layers
            args = dict(x_ptr=e, qw_ptr=e, kw_ptr=e, cos_ptr=e, sin_ptr=e, q_ptr=e, k_ptr=e, v_ptr=e, cos_rows=CANVAS,
                        stride_x=(nq + nkv * (1 + has_v)) * d, stride_c=d, eps=1e-6, D=d)
            out.append(spec("fused._qkv_norm_rope_kernel", f"{dt} d={d}", target, args,
                            dict(NQ=nq, NKV=nkv, HAS_V=has_v, IS_BF16=dt == "bf16", BLOCK_D=d), False))
        out.append(spec("fused._gelu_mul_kernel", dt, target, dict(x_ptr=e, out_ptr=e, inner=2112, stride_x=4224),
                        dict(IS_BF16=dt == "bf16", BLOCK=1024), False))
        out.append(spec("fused._router_input_kernel", dt, target, dict(x_ptr=e, s_ptr=e, out_ptr=e, H=H, root=0.02,
                                                                      eps=1e-6),
                        dict(IS_BF16=dt == "bf16", BLOCK=1 << (H - 1).bit_length()), False))
        out.append(spec("fused._route_kernel", dt, target, dict(l_ptr=e, s_ptr=e, w_ptr="*fp32", i_ptr="*i64", E=128),
                        dict(K=8, BLOCK_E=128, BLOCK_K=8), False))
        out.append(spec("moe._combine_kernel", dt, target, dict(y_ptr=e, out_ptr=e, H=H),
                        dict(TOPK=8, IS_BF16=dt == "bf16", BLOCK=1024), False))
    for bm in (64, 128):
        out.append(spec("moe._align_kernel", f"BLOCK_M={bm}", target, dict(
            flat_ptr="*i64", pair_ptr="*i32", block_expert_ptr="*i32", NK=CANVAS * 8, E=128, n_slots=CANVAS * 8 * 2,
            n_blocks=64), dict(BM=bm, BLOCK_E=128, BLOCK_P=64), False))
    return out


def _moe_variants(target: str):
    """(label, activation dtype, weight dtype, scale dtype or None, dynamic) as experts_triton can be called:
    dense experts in the model dtype; FP8 weight-only (the bytes decoded with integer ops) on both targets, with
    bf16 or fp32 scales; dynamic FP8 only on sm_89+ (Triton has no e4m3 type below: kernels/dispatch.py::fp8_experts
    runs the reference there)."""
    for dt in DT:
        yield dt, dt, dt, None, False
        for sdt in DT:
            yield f"{dt} fp8-w s={sdt}", dt, FP8, sdt, False
            if TARGETS[target][0] >= 89:
                yield f"{dt} fp8-dyn s={sdt}", dt, FP8, sdt, True


def _moe_tiles(dt: str, dyn: bool):
    """(label suffix, BLOCK_M, BLOCK_N, launch options or None for the wrapper's) for each tile experts_triton
    can launch on CUDA: the fixed one, and for bf16 without dynamic FP8 every autotuned configuration."""
    from dgcli.kernels.moe import BLOCK, TUNE

    yield "", BLOCK, BLOCK, None
    if dt == "bf16" and not dyn:
        for bm, tiles in TUNE.items():
            for bn, warps, stages in tiles:
                yield f" tuned {bm}x{bn} w{warps} s{stages}", bm, bn, dict(num_warps=warps, num_stages=stages)


def _moe(target: str) -> list[dict]:
    from dgcli.kernels.moe import BLOCK, launch_options

    out = []
    for label, dt, wdt, sdt, dyn in _moe_variants(target):
        fp8 = sdt is not None
        tc = dt == "bf16" or dyn  # fp32 storage runs full-precision (ieee) dots: no tensor cores, by design
        scale = "*" + (sdt or dt)
        wdt = "u8" if fp8 and not dyn else wdt  # weight-only: the e4m3 bytes, decoded in the kernel
        gu = dict(x_ptr="*" + (FP8 if dyn else dt), w_ptr="*" + wdt, pair_ptr="*i32", block_expert_ptr="*i32",
                  act_ptr="*" + dt, xs_ptr="*" + ("fp32" if dyn else dt), ws_ptr=scale, H=H, I=I, TOPK=TOPK,
                  stride_xn=H, stride_we=2 * I * H, stride_wr=H, stride_an=I, stride_se=2 * I if fp8 else H)
        dn = dict(act_ptr="*" + (FP8 if dyn else dt), w_ptr="*" + wdt, pair_ptr="*i32", block_expert_ptr="*i32",
                  rw_ptr="*fp32", y_ptr="*" + dt, as_ptr="*" + ("fp32" if dyn else dt), ws_ptr=scale, H=H, I=I,
                  stride_an=I, stride_we=H * I, stride_wr=I, stride_yn=H, stride_se=H)
        for suffix, bm, bn, opts in _moe_tiles(dt, dyn):
            flags = dict(IS_BF16=dt == "bf16", DOT_BF16=dt == "bf16", W_FP8=fp8, A_FP8=dyn, BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_K=BLOCK)
            opts = launch_options(fp8, dyn, dt == "bf16") if opts is None else opts
            out.append(spec("moe._gate_up_kernel", label + suffix, target, gu, flags, tc, opts))
            out.append(spec("moe._down_kernel", label + suffix, target, dn, flags, tc, opts))
    return out


def _fp8_linear(target: str) -> list[dict]:
    """The weight-only GEMMs at their CUDA launch configs, for the real linears' widths (e.g. q, 16 heads x 256, and
    o): W8A16 (kernels/fp8_linear.py) with bf16 or fp32 scales, W4A16 (kernels/nvfp4_triton.py) with its global
    scale divided or multiplied; and dynamic FP8's quantizer."""
    from dgcli.kernels import fp8_linear, nvfp4_triton

    out = []
    for dt, (n, k) in ((dt, nk) for dt in DT for nk in ((4096, H), (H, 4096))):
        for mod, kernel, variants in ((fp8_linear, "fp8_linear._w8a16_kernel", DT), (nvfp4_triton,
                                      "nvfp4_triton._w4a16_kernel", ("divide", "multiply"))):
            bm, bn, bk, warps, stages = mod.CONFIGS[dt]
            flags = dict(IS_BF16=dt == "bf16", DOT_BF16=dt == "bf16", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         GROUP=fp8_linear.GROUP_M)
            for v in variants:
                args = dict(x_ptr="*" + dt, y_ptr="*" + dt, M=CANVAS, N=n, K=k, stride_xm=k, stride_ym=n) | (dict(
                    q_ptr="*u8", s_ptr="*" + v, stride_qn=k) if mod is fp8_linear else dict(
                    p_ptr="*u8", s_ptr="*u8", g_ptr="*fp32", stride_pn=k // 2, stride_sn=k // 16))
                label = f"{dt} s={v} {n}x{k}" if mod is fp8_linear else f"{dt} {v} {n}x{k}"
                out.append(spec(kernel, label, target, args, flags | (
                    {} if mod is fp8_linear else dict(DIVIDE=v == "divide")), dt == "bf16",
                    dict(num_warps=warps, num_stages=stages)))
    for dt, k in ((dt, k) for dt in DT for k in (H, I)):  # the quantizer: the layers' input, the experts' middle
        out.append(spec("fp8_linear._quant_kernel", f"{dt} K={k}", target, dict(
            x_ptr="*" + dt, q_ptr="*u8", s_ptr="*fp32", K=k, stride_x=k, stride_q=k),
            dict(BLOCK=min(4096, 1 << (k - 1).bit_length())), False))
    return out


def _vocab(target: str) -> list[dict]:
    from dgcli.kernels.vocab_pass import GROUP_BLOCK_K, SOFT_SPLITS, SOFT_TUNE, TILE, VOCAB_SPLITS

    out = []
    bn, bk = TILE["BLOCK_N"], TILE["BLOCK_K"]
    splits = max(1, min(_cdiv(V, bn), VOCAB_SPLITS))
    per_split = _cdiv(_cdiv(V, splits), bn) * bn
    per_soft = _cdiv(_cdiv(V, SOFT_SPLITS), bk) * bk
    for dt in DT:
        e = "*" + dt
        tc = dt == "bf16"
        for cap in (True, False):
            base = dict(IS_BF16=dt == "bf16", DOT_BF16=dt == "bf16", HAS_SOFTCAP=cap, **TILE)
            for soft in (True, False):
                args = dict(h_ptr=e, e_ptr=e, temp_ptr="*fp32", m_ptr="*fp32", z_ptr="*fp32", s_ptr="*fp32",
                            amax_ptr="*i32", zb_ptr="*fp32", tm_ptr="*fp32", tz_ptr="*fp32", l_ptr=e, N=CANVAS, V=V,
                            H=H, n_tiles=_cdiv(V, bn), cols_per_split=per_split, stride_h=H, stride_e=H,
                            stride_l=V if soft else 0, softcap=30.0)
                out.append(spec("vocab_pass._stats_kernel", f"{dt} cap={int(cap)} soft={int(soft)}", target, args,
                                dict(base, WANT_SOFT=soft), tc, spill_ok=SPILL_EXCEPTIONS["vocab_pass._stats_kernel"]))
        # The soft kernel: every autotuned configuration (kernels/vocab_pass.py::SOFT_TUNE) and the fixed one.
        for bm, bn_soft, warps, stages in sorted({(TILE["BLOCK_M"], TILE["BLOCK_N"], 4, 3), *SOFT_TUNE[dt]}):
            args = dict(p_ptr=e, e_ptr=e, part_ptr="*fp32", N=CANVAS, V=V, H=H, cols_per_split=per_soft, stride_p=V,
                        stride_e=H, stride_ps=CANVAS * H, stride_pn=H)
            flags = dict(DOT_BF16=dt == "bf16", BLOCK_M=bm, BLOCK_N=bn_soft, BLOCK_K=bk)
            out.append(spec("vocab_pass._soft_kernel", f"{dt} {bm}x{bn_soft} w{warps} s{stages}", target, args, flags,
                            tc, dict(num_warps=warps, num_stages=stages)))
        out.append(spec("vocab_pass._probs_kernel", dt, target, dict(l_ptr=e, mb_ptr="*fp32", zb_ptr="*fp32", N=CANVAS,
                                                                     V=V, stride_l=V), dict(IS_BF16=dt == "bf16",
                                                                                            BLOCK=1024), False))
        args = dict(m_ptr="*fp32", z_ptr="*fp32", s_ptr="*fp32", amax_ptr="*i32", zb_ptr="*fp32", mb_ptr="*fp32",
                    ent_ptr="*fp32", arg_ptr="*i64", zbt_ptr="*fp32", N=CANVAS, S=splits)
        out.append(spec("vocab_pass._combine_kernel", dt, target, args, dict(IS_BF16=dt == "bf16", BLOCK=128), False))
        for cap in (True, False):  # the draw's per-row group logits: a reduction, no tensor cores by design
            args = dict(h_ptr=e, e_ptr=e, g_ptr="*i64", temp_ptr="*fp32", out_ptr="*fp32", V=V, H=H, stride_h=H,
                        stride_e=H, softcap=30.0)
            out.append(spec("vocab_pass._group_logits_kernel", f"{dt} cap={int(cap)}", target, args,
                            dict(HAS_SOFTCAP=cap, IS_BF16=dt == "bf16", WIDTH=bn, BLOCK_K=GROUP_BLOCK_K), False))
    return out


def _attention(target: str) -> list[dict]:
    """paged_attention's kernels as its wrapper launches them on CUDA (kernels/paged_attention.py::launches, which
    the wrapper calls) at the real layers' shapes: sliding (16 heads on 8 kv, d 256, a ring, the pass's own keys
    fresh), full (16 on 2, d 512) and d 128, with a table too short to split and one reaching 4,096 positions."""
    import torch

    from dgcli.kernels.paged_attention import launches

    out = []
    for (dt, dtype), (n_heads, n_kv, d, ring), reach in itertools.product(
            (("bf16", torch.bfloat16), ("fp32", torch.float32)),
            ((16, 8, HEAD_DIMS[0], True), (16, 2, HEAD_DIMS[1], False), (8, 4, 128, False)), (512, 4096)):
        e, pool, part = "*" + dt, 4096 * 64 * d, CANVAS * n_heads * d  # a kv head of the pool (4,096 x 64); a piece
        for kernel, flags, opts in launches(d, n_heads // n_kv, dtype, reach):
            args = dict(o_ptr=e, lo_ptr="*i32", hi_ptr="*i32", t0_ptr="*i32", tn_ptr="*i32", part_ptr="*fp32",
                        ml_ptr="*fp32", D=d, stride_on=n_heads * d, stride_oh=d, stride_ps=part)
            if kernel == "_paged_attention_kernel":
                flags = dict(flags, BLOCK_SIZE=64, RING=ring, FRESH=ring)
                args.update(q_ptr=e, k_ptr=e, v_ptr=e, seq_ptr="*i32", tab_ptr="*i32", kn_ptr=e, vn_ptr=e,
                            fp_ptr="*i32", fr_ptr="*i32", ring_blocks=20, stride_qn=n_heads * d, stride_qh=d,
                            stride_kh=pool, stride_ks=d, stride_vh=pool, stride_vs=d, stride_t=64, stride_kn=n_kv * d,
                            stride_knh=d, stride_vn=n_kv * d, stride_vnh=d)
            out.append(spec(f"paged_attention.{kernel}", f"{dt} d={d} g={n_heads // n_kv} splits={flags['SPLITS']}",
                            target, args, flags, dt == "bf16" and kernel == "_paged_attention_kernel", opts))
    return out


def configs(targets=tuple(TARGETS)) -> list[dict]:
    """Every configuration the CUDA launch wrappers can launch, for each target."""
    return [c for t in targets for make in (_rmsnorm, _moe, _fp8_linear, _vocab, _attention) for c in make(t)]


# --- the child process: compile and measure --------------------------------------------------------------


def _signature(fn, args: dict, constexprs: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    missing = set(fn.arg_names) - set(args) - set(constexprs)
    if missing:
        raise ValueError(f"{fn.__name__}: no value for {sorted(missing)}")
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, str):  # a tensor: torch's allocations are 16-byte aligned
            sig[name], div = v, True
        elif isinstance(v, int):
            sig[name], div = ("i32" if -2**31 <= v < 2**31 else "i64"), v % 16 == 0
        else:
            sig[name], div = "fp32", False
        if div:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _resources(cubin: bytes, name: str) -> dict:
    """Registers, stack frame and local memory per thread, from cuobjdump -res-usage."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    got = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text.split(f"Function {name}:", 1)[-1]))
    return {k.lower(): int(v) for k, v in got.items()}


def compile_one(c: dict) -> dict:
    """Compile one configuration (in a process without TRITON_INTERPRET) -> its measurements or its error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = c["kernel"].split(".")
    fn = getattr(importlib.import_module(f"dgcli.kernels.{module}"), name)
    cap = TARGETS[c["target"]][0]
    try:
        sig, attrs = _signature(fn, c["args"], c["constexprs"])
        k = triton.compile(ASTSource(fn, sig, c["constexprs"], attrs), target=GPUTarget("cuda", cap, 32),
                           options=c["options"])
    except Exception as e:  # noqa: BLE001 - a failed compile is a result to report
        lines = str(e).strip().splitlines() or [""]
        return dict(error=f"{type(e).__name__}: {lines[-1][:300]}")  # Triton's last line names the cause
    ptx = k.asm["ptx"]
    marks = sorted(set(TC_ANY.findall(ptx)))
    return dict(shared=k.metadata.shared, num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages,
                tc=[m for m in ("wgmma", "mma") if m in marks], ptx_local=".local" in ptx,
                mma_sync="mma.sync" in ptx, **_resources(k.asm["cubin"], k.metadata.name))


def compile_configs(cfgs: list[dict]) -> list[dict]:
    """Each config with its `result`, compiled in a child process (TRITON_INTERPRET unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "--compile-json"], input=json.dumps(cfgs), text=True,
                          capture_output=True, env=env, cwd=ROOT, check=False)
    if proc.returncode:
        raise RuntimeError(f"kernel_targets child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [dict(c, result=r) for c, r in zip(cfgs, json.loads(proc.stdout))]


def problems(c: dict) -> list[str]:
    """What is wrong with a compiled configuration (empty: it passes)."""
    r = c["result"]
    if "error" in r:
        return [f"does not compile: {r['error']}"]
    cap, limit, mark = TARGETS[c["target"]]
    out = []
    if r["shared"] > limit:
        out.append(f"shared memory {r['shared']} B > {limit} B per block on {c['target']}")
    has = mark == "wgmma" and "wgmma" in r["tc"] or mark == "mma.sync" and r["mma_sync"]
    if c["tensor_core"] and not has:
        out.append(f"no {mark} in the PTX: the dot misses the tensor cores")
    if c["tensor_core"] and mark == "wgmma" and r["mma_sync"]:  # every dot, not only one of them
        out.append("mma.sync in the PTX: a dot misses wgmma")
    if not c["tensor_core"] and r["tc"]:
        out.append(f"unexpected tensor-core instruction {r['tc']} (this configuration means full fp32 products)")
    if r.get("stack", 0) > c["spill_ok"] or r.get("local", 0) or r["ptx_local"]:
        out.append(f"spills: stack frame {r.get('stack')} B (accepted {c['spill_ok']}), local {r.get('local')} B")
    return out


def table(done: list[dict]) -> str:
    """One row per kernel and target: configurations, max shared memory, registers, spills, tensor cores."""
    rows = {}
    for c in done:
        rows.setdefault((c["kernel"], c["target"]), []).append(c)
    lines = ["| kernel | target | configs | shared (max B) | regs (max) | stack/spill (max B) | tensor core "
             "| failing |", "|---|---|---|---|---|---|---|---|"]
    for (kernel, target), cs in rows.items():
        ok = [c["result"] for c in cs if "error" not in c["result"]]
        marks = ["wgmma" if "wgmma" in r["tc"] else "mma.sync" if r["mma_sync"] else "+".join(r["tc"]) or "none"
                 for r in ok]
        tcs = [f"{m} x{marks.count(m)}" for m in sorted(set(marks), reverse=True)]
        failing = [c["label"] for c in cs if problems(c)]
        lines.append(f"| {kernel} | {target} | {len(cs)} | {max((r['shared'] for r in ok), default='-')} | "
                     f"{max((r.get('reg', 0) for r in ok), default='-')} | "
                     f"{max((r.get('stack', 0) + r.get('local', 0) for r in ok), default='-')} | "
                     f"{', '.join(tcs)} | {'; '.join(failing) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compile-json"]:
        sys.path.insert(0, str(ROOT))
        json.dump([compile_one(c) for c in json.load(sys.stdin)], sys.stdout)
        return 0
    args = parser(__doc__).parse_args(argv)
    cfgs = configs()
    if args.dry_run:  # one configuration per kernel and target
        cfgs = list({(c["kernel"], c["target"]): c for c in reversed(cfgs)}.values())[::-1]
    seconds, done = wall(lambda: compile_configs(cfgs))
    print(table(done))
    from kernel_floor import attention_times, computed_table  # each kernel's computed H100 time against its floor

    print("\n" + computed_table())
    print("\npaged attention per layer call, H100 SXM, computed (not measured):\n" + attention_times())
    bad = [(c, p) for c in done for p in problems(c)]
    for c, p in bad:
        print(f"FAIL {c['kernel']} {c['target']} [{c['label']}]: {p}")
    emit({"bench": "kernel_targets", "configs": len(done), "failing": len(bad), "compile_s": round(seconds, 1)})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
