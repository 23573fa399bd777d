"""The package's layering: no import cycle between modules, and no module importing a layer above its own.

Every ``import`` / ``from ... import`` in every module under ``dllm/`` counts, at any depth (function-local
imports included: they run too). Layers, lowest first (a module may import its own layer and those below):

    config, ops, kernels, assets        numbers and data
    models                              the network and its checkpoints
    caches, blocks, samplers            the three decoding axes
    recipes                             a preset = sampler + block layout + cache, resolved once
    generate                            the decode loop
    blockdiff, viz                      block-diffusion decoding (SDAR); pictures of trajectories
    evals, tiny                         evaluation suites; tiny-model training
    serve                               the serving engine and HTTP server
    dllm (the package's public names)   re-exports for users
    cli                                 the command line
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    {"config", "ops", "kernels", "assets"},
    {"models"},
    {"caches", "blocks", "samplers"},
    {"recipes"},
    {"generate", "graphs"},
    {"blockdiff", "viz"},
    {"evals", "tiny"},
    {"serve"},
    {"dllm"},
    {"cli", "__main__"},
]
LEVEL = {name: i for i, group in enumerate(LAYERS) for name in group}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for f in (root / "dllm").rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the dllm modules it imports (a ``from pkg import sub`` counts as importing ``pkg.sub``)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs + ([mod] if len(subs) < len(node.names) else [])
            for t in targets:
                if t.split(".")[0] != "dllm":
                    continue
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != name:
                    graph[name].add(t)
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "dllm"
    if top not in LEVEL:
        raise AssertionError(f"dllm.{top} is in no layer: add it to LAYERS in tests/test_layering.py")
    return LEVEL[top]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if layer(b) > layer(a))


def test_no_import_cycle():
    found = cycles(imports(modules(ROOT)))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_layer_above_it():
    bad = upward(imports(modules(ROOT)))
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


def test_every_top_level_module_has_a_layer():
    for name in modules(ROOT):
        layer(name)


def test_the_checks_catch_what_they_should(tmp_path):
    """The graph reads relative, function-local and ``from pkg import sub`` imports; a cycle and an upward
    import in a made-up package are reported."""
    pkg = tmp_path / "dllm"
    (pkg / "models").mkdir(parents=True)
    (pkg / "evals").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("def f():\n    from dllm.evals import tasks\n")
    (pkg / "evals" / "__init__.py").write_text("")
    (pkg / "evals" / "tasks.py").write_text("from ..models import a\n")
    graph = imports(modules(tmp_path))
    assert graph["dllm.models.a"] == {"dllm.evals.tasks"}
    assert graph["dllm.evals.tasks"] == {"dllm.models.a"}
    assert cycles(graph) == [["dllm.evals.tasks", "dllm.models.a"]]
    assert upward(graph) == ["dllm.models.a -> dllm.evals.tasks"]
    with pytest.raises(AssertionError, match="in no layer"):
        layer("dllm.nowhere")
