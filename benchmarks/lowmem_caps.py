"""The real-size 26B-A4B at 4 bits on a small machine: a random Q4_K_M GGUF of the released config written to a
file (`write_random_gguf`: llama.cpp's type mix, random valid blocks; ~14.4 GiB), then `dgemma bench --model FILE`
in a child cgroup of the memory controller under each memory cap (default 16, 12 and 8 GiB), the file's pages
dropped from the page cache before each run (POSIX_FADV_DONTNEED on the GGUF file and its kernels' cache file:
only these files, not the machine's whole cache). A first run under the largest cap writes the cache file (the
int4 form of the Q4_K matrices, checkpoint/mapped.py); it is reported apart.

Reported per cap: the step time (bench's mean_step_ms), peak RSS (the child's ru_maxrss), bytes read from disk
(its ru_inblock) in all and per decoder pass (the load's included), the cgroup's peak usage and OOM kills, and
whether it finished; and the disk's read rate (dgcli's `read_rate`: 256 MiB of the file past the page cache).
Never runs a real-size model without a cap (it would take ~22 GB): no capped cgroup, no run (one line, exit 2).
Timings on a shared machine are noise; RSS, bytes read and "finished without an OOM kill" are what it shows.

    python benchmarks/lowmem_caps.py [--caps 16,12,8] [--dir /var/tmp/dgemma-lowmem] [--steps 2] [--keep]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import TINY, card_line, dgemma_exe, emit, fail, machine, parser, wall

GIB = 2**30


def cgroup_root() -> Path | None:
    """This process's memory cgroup folder where a child can be made (root, v1 or v2), else None."""
    from dgcli.runtime.preflight import _cgroup_folders

    folders = _cgroup_folders()
    return folders[0] if folders and os.geteuid() == 0 and os.access(folders[0], os.W_OK) else None


def drop_cache(*paths: Path) -> None:
    for p in paths:
        if p.exists():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def capped_run(root: Path | None, cap: int, argv: list[str]) -> dict:
    """argv in a new child cgroup capped at `cap` bytes (None root: uncapped, dry runs only): its result, peak RSS,
    bytes read from disk, and the cgroup's peak and OOM kills."""
    cg = None
    if root is not None:
        cg = root / f"dgemma-lowmem-{os.getpid()}"
        cg.mkdir()
        v2 = (cg / "memory.max").exists()
        (cg / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(cap))
        argv = ["sh", "-c", f'echo $$ > {cg / "cgroup.procs"} && exec "$@"', "sh", *argv]
    try:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
            secs, (_, status, ru) = wall(lambda: os.wait4(p.pid, 0))  # this child's own rusage
            p.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0), err.seek(0)
            out, err = out.read(), err.read()
        row = {"exit": p.returncode, "wall_s": secs, "peak_rss": ru.ru_maxrss * 1024, "read_bytes": ru.ru_inblock * 512,
               "stderr_tail": err.strip().splitlines()[-1:] if p.returncode else []}
        if cg is not None:
            v2 = (cg / "memory.max").exists()
            row["cgroup_peak"] = int((cg / ("memory.peak" if v2 else "memory.max_usage_in_bytes")).read_text()) \
                if (cg / ("memory.peak" if v2 else "memory.max_usage_in_bytes")).exists() else None
            events = (cg / ("memory.events" if v2 else "memory.oom_control")).read_text().split()
            row["oom_kills"] = int(events[events.index("oom_kill") + 1]) if "oom_kill" in events else None
        try:
            row["bench"] = json.loads(out)["rows"][0]
        except (ValueError, KeyError, IndexError):
            row["bench"] = None
        return row
    finally:
        if cg is not None:
            cg.rmdir()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--caps", default="16,12,8", help="memory caps in GiB, comma-separated")
    ap.add_argument("--dir", default="/var/tmp/dgemma-lowmem", help="where the GGUF file (and its cache) are written")
    ap.add_argument("--steps", type=int, default=2, help="denoising steps per block (one block, one prompt)")
    ap.add_argument("--keep", action="store_true", help="keep the GGUF file and its cache afterwards")
    args = ap.parse_args()
    from dgcli.checkpoint.config import read_json
    from dgcli.checkpoint.mapped import cache_path, read_rate
    from dgcli.checkpoint.random_weights import dummy_config, write_random_gguf

    root = cgroup_root()
    try:
        caps = [int(float(c) * GIB) for c in args.caps.split(",")]
    except ValueError:
        fail("lowmem_caps.py", f"--caps {args.caps}: give GiB numbers, e.g. 16,12,8")
    if args.dry_run:  # the benchmarks' tiny config at 2 layers, caps that fit it
        raw, caps = read_json(TINY), [2 * GIB, GIB]
    else:
        if root is None:
            fail("lowmem_caps.py", "needs root and a memory cgroup to cap each run (a real-size run uncapped would "
                 "take ~22 GB); run it as root on a machine with the memory controller")
        raw = dummy_config("26B-A4B")[0]
    folder = Path(tempfile.mkdtemp(prefix="dgemma-lowmem-")) if args.dry_run else Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("tiny-q4_k_m.gguf" if args.dry_run else "26B-A4B-random-q4_k_m.gguf")
    card = machine(peaks=False)
    print(card_line(card))
    if not path.exists():
        secs, size = wall(lambda: write_random_gguf(raw, None, path, "q4_k_m", name=path.stem))
        print(f"wrote {path}: {size / GIB:.2f} GiB in {secs:.0f} s")
    size = path.stat().st_size
    cache = cache_path(path, "bfloat16")
    rate = read_rate(path)
    print(f"disk read rate: {rate / 1e6:.0f} MB/s (256 MiB of the file past the page cache)" if rate
          else "disk read rate: unknown")
    argv = [dgemma_exe(), "bench", "--model", str(path), "--random-prompts", "--num-prompts", "1", "--runs", "1",
            "--blocks", "1", "--diffusion-steps", str(args.steps), "--no-measure-peaks", "--format", "json"]
    rows = []
    try:
        for label, cap in [("first load (writes the cache)", max(caps))] + [(f"{c / GIB:g} GiB", c) for c in caps]:
            drop_cache(path, cache)
            r = capped_run(root, cap, argv)
            b = r.pop("bench") or {}
            passes = ((b.get("warmups") or 0) + (b.get("runs") or 1)) * (b.get("batched_decoder_passes") or 1)
            rows.append(dict(label=label, cap=cap if root else None, finished=r["exit"] == 0,
                             step_ms=b.get("mean_step_ms"), read_per_pass=r["read_bytes"] / passes, **r))
            print(f"{label:>30}: exit {r['exit']}, step {b.get('mean_step_ms') or float('nan'):.0f} ms, peak RSS "
                  f"{r['peak_rss'] / GIB:.2f} GiB, read {r['read_bytes'] / GIB:.2f} GiB "
                  f"({rows[-1]['read_per_pass'] / GIB:.2f} GiB a pass, load included), cgroup peak "
                  f"{(r.get('cgroup_peak') or 0) / GIB:.2f} GiB, OOM kills {r.get('oom_kills')}", flush=True)
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            cache.unlink(missing_ok=True)
            if args.dry_run:
                folder.rmdir()
    emit({"bench": "lowmem_caps", "file": str(path), "file_bytes": size, "read_rate": rate, "capped": root is not None,
          "rows": rows, "machine": card, "dry_run": args.dry_run})


if __name__ == "__main__":
    main()
