"""The imports of deepcompile point one way.

Every import in every module of the core is read from the source, those inside functions too
(an import deferred into a function is still a dependency, only a later one), and resolved to the
module it names. The tests fail naming the offending imports (file and line), so a change that
closes a circle is told where, not just that.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "deepcompile"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _resolve(name: str, mods: dict) -> str | None:
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{module: {imported module: ["file:line", ...]}} over deepcompile's own modules."""
    mods = _modules()
    graph: dict[str, dict[str, list[str]]] = {m: defaultdict(list) for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                # `from package import module` names the module; `from module import name`, the module
                names = [f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full for a in node.names]
            for name in names:
                if not name.startswith("deepcompile"):
                    continue
                target = _resolve(name, mods)
                where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                if target and target != mod and where not in graph[mod][target]:
                    graph[mod][target].append(where)
    return graph


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40, f"found only {len(graph)} modules under {ROOT}"
    problems = []
    for comp in _cycles(graph):
        inside = set(comp)
        edges = [f"    {m} -> {t} ({', '.join(where)})" for m in comp for t, where in sorted(graph[m].items())
                 if t in inside]
        problems.append(f"  a circle of {len(comp)} modules:\n" + "\n".join(edges))
    assert not problems, "deepcompile's imports must point one way:\n" + "\n".join(problems)


def _reaches_outside(graph, prefix: str, allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for mod, targets in graph.items():
        if mod != prefix and not mod.startswith(prefix + "."):
            continue
        for t, where in targets.items():
            if not any(t == a or t.startswith(a + ".") for a in (prefix,) + allowed):
                bad.append(f"  {mod} -> {t} ({', '.join(where)})")
    return bad


def test_the_torch_shims_import_nothing_of_deepcompile():
    bad = _reaches_outside(import_graph(), "deepcompile.compat", ())
    assert not bad, "deepcompile.compat holds torch shims only, beneath everything:\n" + "\n".join(bad)


def test_the_runtime_stands_on_the_shims_alone():
    bad = _reaches_outside(import_graph(), "deepcompile.runtime", ("deepcompile.compat",))
    assert not bad, "deepcompile.runtime may import only deepcompile.compat:\n" + "\n".join(bad)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:1"]}, "c": {"a": ["c.py:3"]}, "d": {"a": ["d.py:1"]}}
    assert _cycles(graph) == [["a", "b", "c"]]


# The layers, bottom first: a module may import its own package and the layers below it, never one
# above. Read as the pipeline: shared words, the torch shims, the native runtime and the row shards
# it executes; the compile machinery and the passes that rewrite graphs; what a profiled step
# measured, the record that keeps it, the plan made from them; then the entry points (config,
# backend, api) and what shows the record (report, cli).
LAYERS = (
    ("deepcompile.version", "deepcompile.params", "deepcompile.vocab", "deepcompile.models"),
    ("deepcompile.compat",),
    ("deepcompile.runtime",),
    ("deepcompile.sharding",),
    ("deepcompile.compile",),
    ("deepcompile.passes",),
    ("deepcompile.profile",),
    ("deepcompile.record",),
    ("deepcompile.plan",),
    ("deepcompile.config",),
    ("deepcompile.backend",),
    ("deepcompile.clip",),
    ("deepcompile.api",),
    ("deepcompile.checkpoint",),
    ("deepcompile.report",),
    ("deepcompile.cli",),
    ("deepcompile", "deepcompile.__main__"),
)


def _place(mod: str) -> tuple[int, str]:
    """(layer, entry) of ``mod``: its longest-matching entry of :data:`LAYERS`."""
    best = None
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if (mod == entry or mod.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    assert best is not None, f"{mod} is in no layer of tests/test_layers.py: LAYERS"
    return best


def test_every_import_points_down_the_layers():
    graph = import_graph()
    up = []
    for mod, targets in sorted(graph.items()):
        layer, entry = _place(mod)
        for t, where in sorted(targets.items()):
            t_layer, t_entry = _place(t)
            if t_entry != entry and t_layer >= layer:
                up.append(f"  {mod} (layer {layer}) -> {t} (layer {t_layer}) ({', '.join(where)})")
    assert not up, ("deepcompile's layers (tests/test_layers.py: LAYERS, bottom first) point one way; "
                    "these imports point up or sideways:\n" + "\n".join(up))


def test_the_vocabulary_imports_nothing_of_deepcompile():
    bad = _reaches_outside(import_graph(), "deepcompile.vocab", ())
    assert not bad, "deepcompile.vocab is the shared words, beneath everything:\n" + "\n".join(bad)
