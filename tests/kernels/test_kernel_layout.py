"""The kernel layer's layout: kernels/ imports nothing of dgcli above it and has no import cycle; outside the model
(and the checkpoint formats it loads from) only the dispatch table (and the switches, the C loader's error, the host
transfers) is imported; two switches."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
# what a layer other than dgcli/model may import of the kernel layer
PUBLIC = {"dispatch", "switches", "native", "transfer"}


def _kernel_imports(path: Path, inside: bool) -> list[tuple[int, str]]:
    """(line, module) for each kernels module `path` imports (`inside`: path is in kernels/, relative imports)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if inside and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
            elif (node.module or "").startswith("dgcli.kernels"):
                rest = node.module.split(".")[2:]
                names = rest[:1] if rest else [a.name for a in node.names]
            else:
                continue
            out += [(node.lineno, n.split(".")[0]) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[2]) for a in node.names if a.name.startswith("dgcli.kernels.")]
    return out


def test_kernels_import_nothing_of_dgcli_above_them():
    bad = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mod = node.module if isinstance(node, ast.ImportFrom) and not node.level else None
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [mod] if mod else []
            bad += [f"{path.name}:{node.lineno} imports {m}" for m in mods
                    if m.startswith("dgcli") and not m.startswith("dgcli.kernels")]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_in_kernels():
    graph = {p.stem: {m for _, m in _kernel_imports(p, True)} - {p.stem} for p in KERNELS.glob("*.py")}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
            if m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


def test_outside_the_model_only_the_dispatch_table_is_imported():
    bad = []
    for path in sorted((ROOT / "dgcli").rglob("*.py")):
        rel = path.relative_to(ROOT / "dgcli")
        if rel.parts[0] in ("kernels", "model", "checkpoint"):  # the model, and the formats it is loaded from
            continue
        bad += [f"{rel}:{line} imports kernels.{m}" for line, m in _kernel_imports(path, False) if m not in PUBLIC]
    assert not bad, "\n".join(bad)


def test_at_most_two_switches():
    names, guards = set(), set()
    for path in KERNELS.rglob("*"):
        if path.suffix in (".py", ".c", ".h"):
            text = path.read_text(encoding="utf-8")
            names |= set(re.findall(r"\bDGEMMA_[A-Z0-9_]*[A-Z0-9]\b", text))
            guards |= set(re.findall(r"^#ifndef (DGEMMA_\w+_H)\n#define \1$", text, re.M))  # a header's own guard
    names -= guards
    assert names <= {"DGEMMA_KERNELS", "DGEMMA_FP8"}, names
