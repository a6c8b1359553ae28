"""The wheel a user installs (`pip install .`, not the editable install the tests run from) holds every source file
and data file of the checkout: a package missing from pyproject.toml's list installs a dgemma that fails at import."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> set[str]:
    """The files the wheel must hold, named as installed (kernels/ and presets/ install inside dgcli/)."""
    tracked = subprocess.run(["git", "ls-files", "dgcli", "kernels", "presets"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    out = set()
    for name in tracked:
        path = ROOT / name
        if path.is_symlink() or path.suffix not in {".py", ".c", ".h", ".json", ".jinja", ".html", ".yaml", ".js",
                                                    ".css", ".txt", ".model", ".safetensors", ".jsonl"}:
            continue
        out.add(name if name.startswith("dgcli/") else f"dgcli/{name}")
    return out


@pytest.mark.slow
def test_the_wheel_holds_every_source_file(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("dgemma-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_sources() - held)
    assert not missing, f"{len(missing)} files not in the wheel, e.g. {missing[:8]}"
