"""The wheelhouse a GPU lease carries: wheels of dgemma's runtime requirements but torch and triton (the device image
has its own CUDA builds of both), and of the test extra's pins the lease's kernel tests import (pytest, hypothesis),
with everything they need, for the image's CPython (3.12: /work/.library/device/KINDS.md) on manylinux x86-64; and
setuptools, the build backend of the offline editable install. About 34 MiB for 3.12: with the tree, within a
lease's 64 MiB `carry`.

    python benchmarks/wheelhouse.py DIR [--python-version 3.12]   # here: needs the package index
    python benchmarks/wheelhouse.py --install DIR                  # the lease's first step (gpu_suite.py --wheels DIR)

`--install` runs `pip install --no-index --find-links DIR -r DIR/requirements.txt`, then dgemma editable without
its dependencies (`--no-deps -e .`: the image's torch stays, whatever its version), fails if torch changed, and
prints the env line. `--dry-run` prints the requirements, nothing installed or fetched.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, gpu_suite
from harness import ROOT, emit, parser  # noqa: E402

WHEEL_PYTHON = "3.12"  # the device image's python3
KEEP = ("torch", "triton")  # the image's CUDA builds: never in the wheelhouse, never touched by the install
LEASE_TEST_DEPS = ("pytest", "hypothesis")  # what the lease's kernel tests import, of the test extra's pins


def requirements() -> list[str]:
    """dgemma's runtime requirements but torch and triton, and the test extra's pins the lease's tests import."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower()  # noqa: E731
    return [r for r in project["dependencies"] if name(r) not in KEEP] + [
        r for r in project["optional-dependencies"]["test"] if name(r) in LEASE_TEST_DEPS]


def build_wheelhouse(dest: Path, python: str) -> None:
    """Wheels of `requirements()` and everything they need, for CPython `python` on manylinux x86-64, into `dest`
    (its old wheels removed: one version of each), with requirements.txt; setuptools too, the build backend of the
    offline editable install. Needs the package index (this machine's); the device never does."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    (dest / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    tags = [f"--platform=manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["--platform=manylinux2014_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation=cp",
                    f"--python-version={python}", *tags, "-d", str(dest), "-r", str(dest / "requirements.txt"),
                    "setuptools>=64"], check=True)
    wheels = sorted(dest.glob("*.whl"))
    kept = [w.name for w in wheels if w.name.split("-")[0].lower() in KEEP or w.name.startswith("nvidia")]
    if kept:
        sys.exit(f"wheelhouse: error: it pulled in {', '.join(kept)}: the image's own must stay")
    emit({"wheelhouse": str(dest), "python": python, "wheels": len(wheels),
          "MiB": round(sum(w.stat().st_size for w in wheels) / 2**20, 1)})


def install_wheels(dest: Path) -> None:
    """The lease's first step: the wheelhouse installed offline (dgemma editable, without its dependencies: the
    image's torch stays whatever its version), then the env line. Fails if torch changed."""
    from importlib.metadata import PackageNotFoundError, version

    def torch_version():
        try:
            return version("torch")
        except PackageNotFoundError:
            return None

    before = torch_version()
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(dest), "--no-cache-dir",
           "--no-compile"]  # .pyc files as imports need them: seconds off the lease
    subprocess.run(pip + ["-r", str(dest / "requirements.txt")], check=True)
    subprocess.run(pip + ["--no-deps", "-e", str(ROOT)], check=True)
    if torch_version() != before:
        sys.exit(f"wheelhouse: error: the install changed torch {before} -> {torch_version()}")
    from gpu_suite import print_env

    print_env()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("dir", nargs="?", help="build the wheelhouse in this folder")
    ap.add_argument("--python-version", default=WHEEL_PYTHON, help="the device's Python (major.minor)")
    ap.add_argument("--install", default=None, help="install this wheelhouse offline (the lease's first step)")
    args = ap.parse_args()
    if args.dry_run or not (args.dir or args.install):
        emit({"requirements": requirements(), "python": args.python_version})
    elif args.install:
        install_wheels(Path(args.install))
    else:
        build_wheelhouse(Path(args.dir), args.python_version)


if __name__ == "__main__":
    main()
