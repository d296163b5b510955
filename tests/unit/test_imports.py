"""The package's import graph has no circles (docs/DESIGN.md, "Dependency direction"): every
``import`` counts, the ones inside functions included, since a function-level import that closes a
circle only hides it."""

from __future__ import annotations

import ast
import os

import distckpt

def _modules() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(distckpt.__file__))
    out = {}
    for dirpath, _, files in os.walk(os.path.dirname(distckpt.__file__)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _graph(mods: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                # A module's own parent packages are initialized before it anyway: not a circle.
                if t in mods and t != mod and not mod.startswith(t + "."):
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def test_no_import_circle():
    graph = _graph(_modules())
    assert "distckpt.storage.posix.saving" in graph["distckpt.storage.posix.store"]  # the walk sees imports
    cycles = _cycles(graph)
    assert len(cycles) == 0, "import circles: " + "; ".join(
        f"{sorted(c)} (edges: { {m: sorted(graph[m] & c) for m in sorted(c)} })" for c in cycles)


def test_the_walk_finds_a_circle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [{"a", "b", "c"}]


# The layers of docs/DESIGN.md ("Dependency direction"), lowest first. A module may import its own
# layer and the ones below, never one above: storage never reaches up into the save or load
# engine, the engine never into the manager, the CLI or an integration. A new module must be given
# a layer here (the test fails on an unknown one), which is the moment to decide where it belongs.
LAYERS = [
    # 0: leaves: errors, sizes, configuration, the checksum, tensors <-> bytes, staging memory
    {"errors", "sizes", "config", "clijson", "gcpause", "checksum", "tensorbytes", "values", "flatten",
     "containers", "tensorrecords", "plan", "where", "_dist", "writewatch", "staging", "staging.pool", "staging.ring",
     "safepickle", "commitclock"},
    # 1: formats: the MANIFEST, a data file's layout, the foreign formats a load can read
    {"manifest", "datafile", "dcp", "hf"},
    # 2: storage: the Store seam and its back ends
    {"storage", "storage.*"},
    # 3: the engine: the save protocol, the load path, chains, verification, listing
    {"saveplan", "commit", "coordinator", "save_sync", "save_async", "fill", "readonce", "chain", "source", "restore",
     "incremental", "deltarecords", "verify", "listing", "chainview"},
    # 4: the doors: manager, conversion, pre-flight report, CLI, benchmarks, integrations, the package
    {"", "__main__", "manager", "rotation", "convert", "bench", "cli", "checks", "checks.*", "integrations", "integrations.*",
     # the tiered checkpoints (issue #25)
     "tiers.drain",
     "tiers.load",
     "tiers", "tiers.nodes", "tiers.localcommit", "tiers.drainer", "tiers.listing", "tiers.manager",
     "tiers.verified", "tiers.peers", "tiers.owner", "tiers.records"},
]


def _layer(module: str) -> int:
    name = module[len("distckpt."):] if module.startswith("distckpt.") else ""
    for i, members in enumerate(LAYERS):
        if name in members or any(m.endswith(".*") and name.startswith(m[:-1]) for m in members):
            return i
    raise AssertionError(f"{module} has no layer in tests/unit/test_imports.py LAYERS: give it one")


def test_no_import_from_a_lower_layer_to_a_higher_one():
    graph = _graph(_modules())
    upward = sorted(f"{m} (layer {_layer(m)}) -> {t} (layer {_layer(t)})"
                    for m, targets in graph.items() for t in targets if _layer(t) > _layer(m))
    assert upward == [], "imports that climb a layer:\n  " + "\n  ".join(upward)


def test_the_layer_check_sees_an_upward_import():
    assert _layer("distckpt.storage.posix.saving") == 2 and _layer("distckpt.commit") == 3
    assert _layer("distckpt.storage.posix.saving") < _layer("distckpt.manager")
