"""The layout is the architecture: which layer may import which, no import cycle between modules, checkpoint
formats decided in checkpoint/ alone, training code kept out of run time, no file over 400 lines, `dgcli.kernels`
resolving to this repository's top-level kernels/, and plain `kernels` never (the PyPI package of that name)."""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dgcli"

# Layer -> the dgcli layers its modules may import (any import, also inside functions). Data flows one
# way: cli -> runtime (settings, session, request) -> checkpoint (formats: which one, and opening it), engine -> model
# (the math) + sampling; measure and render consume events. The model never imports checkpoint/: the network is
# built and filled from there, not the other way round.
ALLOWED = {
    "text": {"text"},
    "sampling": {"sampling", "kernels"},  # the sampler's rules: no engine, no model
    "engine": {"engine", "sampling", "kernels"},  # drives the model it is given: imports none of it
    "model": {"model", "kernels", "engine"},  # the engine's KV cache (engine/kv_cache.py): what the passes read/write
    "checkpoint": {"checkpoint", "model", "kernels", "text"},  # a checkpoint's tokenizer (GGUF vocab, text.build)
    "runtime": {"runtime", "checkpoint", "model", "engine", "sampling", "text", "measure"},  # measure.cost: preflight
    "measure": {"measure", "runtime", "checkpoint", "model", "sampling", "text", "kernels"},
    "render": {"render", "sampling"},
    "serve": {"serve", "runtime", "engine", "sampling", "text"},  # the HTTP server: requests in, the engine thread
    "cli": {"cli", "runtime", "checkpoint", "model", "sampling", "text", "measure", "render", "kernels", "serve",
            "cluster"},
    "cluster": {"cluster", "runtime", "checkpoint", "model", "sampling", "text", "measure", "kernels"},  # --ray
    "train": {"train", "runtime", "checkpoint", "model", "engine", "sampling", "text", "measure", "kernels"},
}
# Import cycles still being taken apart elsewhere (each a set of modules that may form one cycle among themselves).
CYCLES_BEING_REMOVED: list[set[str]] = []  # none left
ALWAYS = {"", "errors"}  # dgcli itself (__version__, load_model) and dgcli.errors


def _layer_of_import(node: ast.AST, module_parts: tuple[str, ...]) -> list[str]:
    """The dgcli layers an import statement names ('' for dgcli itself)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against the module's package
            base = list(module_parts[: len(module_parts) - node.level])
            names = [".".join(base + ([node.module] if node.module else []))]
        else:
            names = [node.module or ""]
        if names[0] == "dgcli":  # `from dgcli import x`: x may be a layer
            return [a.name if a.name in ALLOWED or a.name == "errors" else "" for a in node.names]
    out = []
    for n in names:
        parts = n.split(".")
        if parts[0] == "dgcli":
            out.append(parts[1] if len(parts) > 1 else "")
    return out


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "kernels":  # the symlink to ../kernels; checked on its own below
            continue
        yield path, rel


def test_every_layer_imports_only_what_it_may():
    bad = []
    for path, rel in _modules():
        layer = rel.parts[0] if len(rel.parts) > 1 else None
        if layer is None:
            continue  # dgcli/__init__.py, errors.py
        parts = ("dgcli",) + rel.with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _layer_of_import(node, parts if rel.name != "__init__.py" else parts[:-1] + ("x",)):
                if target not in ALWAYS and target not in ALLOWED[layer]:
                    bad.append(f"{rel}:{node.lineno} imports dgcli.{target}")
    assert not bad, "\n".join(bad)


def _module_graph() -> dict[str, set[str]]:
    """dgcli module -> the dgcli modules it imports (any import, also inside functions; kernels/ aside, checked
    on its own). `from pkg import name` names the submodule pkg.name where there is one, else pkg itself:
    importing a package's submodule runs the package's __init__ first, but that is no edge back to it."""
    files = {}
    for path, rel in _modules():
        parts = ("dgcli",) + rel.with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # the module a dotted name lives in (a function or class: its module)
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name) if name.split(".")[0] == "dgcli" and not name.startswith("dgcli.kernels") else None
                if target and target != mod:
                    out.add(target)
        graph[mod] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.add(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(scc)
    return found


def test_no_import_cycle_between_modules():
    graph = _module_graph()
    assert {"dgcli.checkpoint.load", "dgcli.model.gemma", "dgcli.cli"} <= set(graph)  # the walk saw the package
    left = [sorted(c) for c in _cycles(graph) if not any(c <= known for known in CYCLES_BEING_REMOVED)]
    assert not left, f"import cycles: {left}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_only_checkpoint_reads_checkpoint_formats():
    """"Directory or GGUF file?" is decided once (checkpoint/load.py's `format_of`) and the file-format libraries
    are imported in checkpoint/ alone; measure/ may read a GGUF header through checkpoint/gguf.py (`dgemma info`),
    and `dgemma quantize` checks that the file it is to write is named .gguf."""
    bad = []
    for path, rel in _modules():
        if rel.parts[0] in ("checkpoint", "train"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{rel}:{node.lineno} imports {m}" for m in mods if m.split(".")[0] in ("safetensors", "gguf")]
            if isinstance(node, ast.Name) and node.id in ("safe_open", "GGUFFile", "is_gguf_path"):
                bad.append(f"{rel}:{node.lineno} uses {node.id}")
            if isinstance(node, ast.Constant) and node.value == ".gguf" and rel != Path("cli/quantize.py"):
                bad.append(f"{rel}:{node.lineno} tests a path for '.gguf'")
    assert not bad, "\n".join(bad)


def test_no_module_outside_train_imports_training_code():
    seen = 0
    for path, rel in _modules():
        if rel.parts[0] == "train":
            continue
        seen += 1
        parts = ("dgcli",) + rel.with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            assert "train" not in _layer_of_import(node, parts), f"{rel}:{node.lineno} imports training code"
    assert seen > 30  # the walk really saw the package


def test_the_walk_catches_a_function_level_import():
    tree = ast.parse("def f():\n    from dgcli.train import tasks\n")
    assert [t for n in ast.walk(tree) for t in _layer_of_import(n, ("dgcli", "cli", "x"))] == ["train"]


def test_no_file_over_400_lines():
    files = [p for p in PKG.rglob("*.py") if "kernels" not in p.relative_to(PKG).parts]
    files += list((ROOT / "kernels").glob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert len(files) > 40 and not long, long


def test_kernels_import_from_this_repository():
    import dgcli.kernels

    here = Path(dgcli.kernels.__file__).resolve().parent
    assert here == ROOT / "kernels" and Path(dgcli.__file__).resolve().parent == PKG


def test_a_plain_checkout_imports_the_kernels(tmp_path):
    """Without the install's finder (a checkout on PYTHONPATH only), `dgcli.kernels` still resolves to the
    top-level kernels/ through the dgcli/kernels symlink."""
    import subprocess
    import sys

    code = ("import sys\n"
            "sys.meta_path = [f for f in sys.meta_path if 'Editable' not in getattr(f, '__name__', '')]\n"
            "sys.path_hooks = [h for h in sys.path_hooks if 'editable' not in repr(h).lower()]\n"
            "sys.path = [p for p in sys.path if 'editable' not in p]\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "import dgcli.kernels.dispatch as d, pathlib\n"
            "print(pathlib.Path(d.__file__).resolve())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(ROOT / "kernels" / "dispatch.py")


def test_the_test_process_never_takes_our_kernels_for_the_pypi_package():
    """`import kernels` names the PyPI package (transformers imports it for its hub kernels), never this
    repository's top-level kernels/: the README's test command keeps the checkout's root off sys.path. Run as
    `python -m pytest` from the root, this fails (the root is on sys.path), and so would every transformers oracle."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("kernels")
    places = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
    folders = (ROOT / "kernels", ROOT / "tests" / "kernels")  # a regular package; a namespace portion
    ours = [p for p in places if p and any(Path(p).resolve().is_relative_to(f) for f in folders)]
    at = [i for i, p in enumerate(sys.path) if Path(p or ".").resolve() == ROOT]
    assert not ours, (f"`import kernels` resolves to {ours[0]} (the repository root is sys.path{at}): run the tests "
                      "with the venv's pytest entry point (.venv/bin/pytest), not `python -m pytest`")
    from transformers.integrations import hub_kernels  # noqa: F401  (imports `kernels` where it is installed)
    from transformers import PreTrainedModel  # noqa: F401  (modeling_utils imports hub_kernels)


def _import_graph() -> dict[str, set[str]]:
    """dgcli module -> the dgcli modules it imports ('engine.request'; a package by its own name). A package that
    resolves its names at first use (a module `__getattr__`, as dgcli.engine's) imports each of its modules."""
    mods = {}
    for path, rel in _modules():
        if rel.parts[0] == "train":
            continue
        parts = rel.with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dgcli":
                base = node.module.removeprefix("dgcli").lstrip(".")
                subs = [f"{base}.{a.name}".lstrip(".") for a in node.names]
                out |= {s for s in subs if s in mods}
                if base in mods and not all(s in mods for s in subs):
                    out.add(base)
            elif isinstance(node, ast.Import):
                out |= {a.name.removeprefix("dgcli.") for a in node.names if a.name.removeprefix("dgcli.") in mods}
        if path.name == "__init__.py" and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                                              for n in tree.body):
            out |= {m for m in mods if m.rsplit(".", 1)[0] == name and m != name}
        graph[name] = out - {name}
    return graph


def test_no_import_cycle_counting_a_lazy_packages_modules():
    graph = _import_graph()
    assert {"engine", "engine.llm_engine", "sampling.rules"} <= set(graph)  # the walk saw the package
    assert "engine.request" in graph["engine"]  # a lazy package's names are its modules'
    assert not _cycles(graph), _cycles(graph)


def test_no_front_end_imports_the_engines_parts():
    """serve/, cluster/, cli/ and runtime/ drive the engine through `dgcli.engine`'s public names only."""
    bad = [f"{name} imports {dep}" for name, deps in _import_graph().items()
           if name.split(".")[0] in ("serve", "cluster", "cli", "runtime")
           for dep in deps if dep.startswith("engine.")]
    assert not bad, bad
