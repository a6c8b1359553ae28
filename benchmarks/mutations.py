"""Does the CPU suite catch GPU bugs? Each mutation below is a realistic GPU bug as a small textual patch (one
string of one file replaced); each is applied alone to a scratch copy of the tree (the files git tracks or would
track), and the test named beside it runs there (pytest, slow tests included). Caught: the test fails; missed: it
passes; "did not apply": the patch's text is no longer in the file (never counted as caught); "fails clean": the
test fails on the unpatched copy too (so it shows nothing). The scratch copy's `dgcli` comes first on the import
path (PYTHONPATH), ahead of the editable install. Prints a table, then one JSON line.

    python benchmarks/mutations.py              # all of them (about 10-20 minutes on two loaded cores)
    python benchmarks/mutations.py --only NAME  # one; --dry-run: one mutation on a one-test scope

Must not: change the working tree (every patch lands in a temporary copy).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, emit, fail, parser

HAZARDS = "tests/model/test_gpu_hazards.py::test_passes_read_nothing_back_wait_for_nothing_and_copy_no_weight"
F = "if DOT_BF16:  # "  # the bf16 tensor-core branches: a dot that drops its running sum
# name -> (file, old text, new text, test, the GPU bug). The first six went unseen by the CPU suite before its
# hazard tests, the bf16 dot fix of the interpreter and the AOT table read from the wrappers; the rest it caught.
MUTATIONS = {
    "experts-item": ("kernels/moe.py", "    n_blocks = triton.cdiv(flat.numel()",
                     "    assert int(flat.max().item()) < num_experts  # a host read inside the experts op\n"
                     "    n_blocks = triton.cdiv(flat.numel()", f"{HAZARDS}[bf16-None]", "a host read inside the experts op"),
    "vocab-sync": ("kernels/vocab_pass.py", "    n = rows.shape[0]\n",
                   "    n = rows.shape[0]\n    if rows.is_cuda:\n        torch.cuda.current_stream().synchronize()\n",
                   f"{HAZARDS}[bf16-None]", "a stream sync inside the vocabulary op"),
    "experts-float": ("kernels/moe.py", "gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()",
                      "gate_up_proj, down_proj = gate_up_proj.float(), down_proj.float()",
                      f"{HAZARDS}[bf16-None]", "the expert weights copied to fp32 on every call"),
    "graphs-no-warmup": ("dgcli/model/graphs.py", "for _ in range(2):", "for _ in range(0):",
                         "tests/model/test_gpu_hazards.py::test_each_graph_is_captured_after_an_eager_run_of_the_same_pass",
                         "a CUDA graph captured before Triton compiled and tuned its kernels"),
    "vocab-block-n-256": ("kernels/vocab_pass.py", "TILE = dict(BLOCK_M=64, BLOCK_N=64,",
                          "TILE = dict(BLOCK_M=64, BLOCK_N=256,", "tests/kernels/test_kernel_targets.py",
                          "the vocabulary pass's default tile spills registers on sm_90"),
    "moe-dot-sum": ("kernels/moe.py", "                gate = tl.dot(a, wg, gate)\n",
                    "                gate = tl.dot(a, wg)\n", "tests/kernels/test_kernel_moe.py -k released_shapes",
                    "the experts' bf16 tensor-core dot drops its running sum"),
    "vocab-dot-sum": ("kernels/vocab_pass.py", F + "the bf16 operands as loaded: the tensor cores at full rate, fp32 "
                      "accumulation\n            acc = tl.dot(a, b, acc)", F + "\n            acc = tl.dot(a, b)",
                      "tests/kernels/test_kernel_vocab_pass.py -k real_hidden_size", "the head GEMM's bf16 tensor-core dot drops its running sum"),
    "fp8-dot-sum": ("kernels/fp8_linear.py", "acc = tl.dot(a, w.to(tl.bfloat16), acc)", "acc = tl.dot(a, w.to(tl.bfloat16))",
                    "tests/kernels/test_fp8_kernels.py -k w8a16_linear_is", "the W8A16 linear's bf16 tensor-core dot drops its running sum"),
    "nvfp4-dot-sum": ("kernels/nvfp4_triton.py", "acc = tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16), acc)",
                      "acc = tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16))", "tests/kernels/test_nvfp4_triton.py",
                      "the NVFP4 linear's bf16 tensor-core dot drops its running sum"),
    "pageable-copy": ("kernels/transfer.py", "torch.empty(host.shape, dtype=dtype, pin_memory=True).copy_(host).to("
                      "device, non_blocking=True)", "host.to(device)",
                      "tests/sampling/test_fake_cuda.py", "a host-to-device copy from pageable memory (waits)"),
    "graphs-stale-ids": ("dgcli/model/graphs.py", "        st.ids[:b * self.c].copy_(ids)\n", "",
                         "tests/sampling/test_graphs.py -k dynamic_engines", "a graph replays the previous pass's tokens"),
    "moe-routing-weight": ("kernels/moe.py", "y = round_to(round_to(acc, IS_BF16) * rw[:, None], IS_BF16)",
                           "y = round_to(acc, IS_BF16)", "tests/kernels/test_kernel_moe.py -k test_triton_matches",
                           "the down GEMM's epilogue drops the routing weights"),
    "fp8-scale": ("kernels/fp8_linear.py", "y = round_to(acc * s[None, :], IS_BF16)", "y = round_to(acc, IS_BF16)",
                  "tests/kernels/test_fp8_kernels.py -k w8a16_linear_is", "the W8A16 epilogue drops the channel scales"),
    "vocab-softcap": ("kernels/vocab_pass.py", "scratch.stride(0) if want_soft else 0, cap, HAS_SOFTCAP=bool(softcap),",
                      "scratch.stride(0) if want_soft else 0, cap, HAS_SOFTCAP=False,",
                      "tests/kernels/test_kernel_vocab_pass.py -k test_triton_matches", "the vocabulary pass ignores the logit softcap"),
    "rmsnorm-block-mean": ("kernels/fused.py", "tl.sum(x * x, axis=0) / n_cols + eps)", "tl.sum(x * x, axis=0) / BLOCK + eps)",
                           "tests/kernels/test_kernel_rmsnorm.py", "RMSNorm's mean over the padded block, not the row"),
}
DRY = ("vocab-block-n-256", "tests/measure/test_memory.py::test_memory_constants_follow_the_kernels")


def scratch_copy(dest: Path) -> Path:
    """The tree's files (tracked, or untracked and not ignored) under dest; links kept (dgcli/kernels)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src, dst = ROOT / name, dest / name
        if src.is_symlink() or src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
    (dest / ".import").mkdir()
    (dest / ".import" / "dgcli").symlink_to(dest / "dgcli")  # only dgcli: a top-level kernels/ would shadow PyPI's
    return dest


def run_test(tree: Path, test: str, timeout: int) -> tuple[int, float]:
    pytest = Path(sys.executable).with_name("pytest")
    env = dict(os.environ, PYTHONPATH=str(tree / ".import"), PYTHONDONTWRITEBYTECODE="1")
    t0 = time.perf_counter()
    try:
        rc = subprocess.run([str(pytest), "-x", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
                             *shlex.split(test)], cwd=tree, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = -1
    return rc, time.perf_counter() - t0


def check(name: str, test: str | None, timeout: int, clean: dict) -> dict:
    """One mutation's row; `clean` keeps each test's exit status on the unpatched copy (run once per test)."""
    path, old, new, named, bug = MUTATIONS[name]
    test = test or named
    with tempfile.TemporaryDirectory(prefix="dgemma-mutation-") as tmp:
        tree = scratch_copy(Path(tmp))
        text = (tree / path).read_text()
        if old in text and test not in clean:
            clean[test] = run_test(tree, test, timeout)[0]
        if old not in text:
            result, secs = "did not apply", 0.0
        elif clean[test] != 0:
            result, secs = "fails clean", 0.0
        else:
            (tree / path).write_text(text.replace(old, new, 1))
            rc, secs = run_test(tree, test, timeout)
            result = "timed out" if rc == -1 else "missed" if rc == 0 else "caught" if rc in (1, 2) else f"exit {rc}"
    return dict(mutation=name, file=path, bug=bug, test=test, result=result, seconds=round(secs, 1))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--only", action="append", help="run only this mutation (repeatable)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per test run")
    args = ap.parse_args()
    unknown = sorted(set(args.only or ()) - set(MUTATIONS))
    if unknown:
        fail("mutations.py", f"no mutation {unknown[0]!r}: choose from {', '.join(MUTATIONS)}")
    plan = [(DRY[0], DRY[1])] if args.dry_run else [(n, None) for n in (args.only or MUTATIONS)]
    rows, clean = [], {}
    print(f"{'mutation':<20} {'result':<14} {'s':>6}  test")
    for name, test in plan:
        row = check(name, test, args.timeout, clean)
        rows.append(row)
        print(f"{name:<20} {row['result']:<14} {row['seconds']:>6}  {row['test']}", flush=True)
    caught = sum(r["result"] == "caught" for r in rows)
    print(f"caught {caught} of {len(rows)}")
    emit({"mutations": rows, "caught": caught, "total": len(rows), "dry_run": args.dry_run})


if __name__ == "__main__":
    main()
