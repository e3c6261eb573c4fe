"""The library's layers, read from its source: imports point down only, and no two
modules import each other, not even from inside a function (docs/design.md, "Layers")."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "sparsebalance")

# Rank of each part of sparsebalance/ (by its first name below the package): a part may
# import parts of a lower rank only (and itself).
RANK = {
    "_C": 0, "pairs": 0, "cp_split": 0, "registry": 0, "io": 0, "config": 0,
    "pipeline": 1, "predictor": 1,
    "ops": 2,
    "batching": 3, "tuning": 3,
    "attention": 4,
    "balancer": 5,
}


def _modules() -> dict:
    """Dotted module name -> path of every .py file under sparsebalance/."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _imports(path: str, modules: dict) -> set:
    """Project modules ``path`` imports anywhere in it (module level or inside functions);
    ``from package import name`` counts as the submodule when ``name`` is one."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "sparsebalance")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "sparsebalance":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules or sub.endswith("._C") else node.module)
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_every_part_has_a_rank(graph):
    parts = {_part(m) for m in graph} - {""}
    assert parts <= set(RANK), f"parts without a layer (add to RANK, docs/design.md): {sorted(parts - set(RANK))}"


def test_imports_point_down(graph):
    upward = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
              if _part(m) and _part(t) and _part(m) != _part(t) and RANK[_part(t)] >= RANK[_part(m)]]
    assert upward == []


def test_the_library_never_imports_the_driver_or_the_tools():
    above = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            above += [f"{m} -> {n}" for n in names if n.startswith(("megatron.training", "tools", "pretrain_gpt"))]
    assert above == []


def _cycles(graph: dict) -> list:
    """Import cycles of ``graph`` (module -> imported modules), by depth-first search."""
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles(graph):
    """Depth-first search over module imports (package __init__ files re-exporting their own
    submodules are edges too, so a submodule importing its package is a cycle)."""
    cycles = _cycles(graph)
    assert cycles == [], cycles


def test_the_checker_sees_function_level_and_upward_imports(tmp_path):
    """The reader above finds an import inside a function and resolves a submodule."""
    src = tmp_path / "mod.py"
    src.write_text("import numpy\n\ndef f():\n    from sparsebalance.attention import packed\n"
                   "    from sparsebalance.ops.plan import build_plan\n")
    modules = _modules()
    assert _imports(str(src), modules) == {"sparsebalance.attention.packed", "sparsebalance.ops.plan"}


# The rooms of the repository, bottom to top (docs/design.md, "Layout"): the library, the
# driver, the user's tools, the experiment harness. A file may import its own room or lower ones.
ROOMS = (("sparsebalance", ("sparsebalance",)), ("driver", ("megatron.training", "pretrain_gpt")),
         ("tools", ("tools",)), ("benchmarks", ("benchmarks",)))
BARE_TOOLS = {f[:-3] for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py")}
BARE_BENCH = {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py")}


def _room_of_file(rel: str) -> int:
    if rel.startswith("sparsebalance/"):
        return 0
    if rel.startswith("megatron/training/") or rel == "pretrain_gpt.py":
        return 1
    return 2 if rel.startswith("tools/") else 3


def _room_of_import(name: str, rel: str):
    """Room of an imported module name, or None for third-party ones. Scripts import their
    siblings by bare name (their folder is sys.path[0]); the harness puts tools/ there too."""
    for rank, (_, prefixes) in enumerate(ROOMS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    top = name.split(".")[0]
    if top in BARE_BENCH and not rel.startswith("tools/"):
        return 3
    if top in BARE_TOOLS or top in BARE_BENCH:
        return 2 if top in BARE_TOOLS else 3
    return None


def _repo_files():
    for folder in ("sparsebalance", "megatron/training", "tools", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if f.endswith(".py"))
    yield "pretrain_gpt.py"


def test_rooms_import_down_only():
    """The library below the driver, the driver below the user's tools, the tools below the
    experiment harness: nothing imports a room above its own, not even inside a function."""
    upward = []
    for rel in _repo_files():
        mine = _room_of_file(rel)
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, rel)).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            for n in names:
                room = _room_of_import(n, rel)
                if room is not None and room > mine:
                    upward.append(f"{rel} -> {n} ({ROOMS[room][0]} above {ROOMS[mine][0]})")
    assert upward == []


def test_the_harness_has_no_import_cycles():
    """Module graph of benchmarks/ (its package modules and its scripts by bare name)."""
    rels = {rel[:-3].replace("/", ".").removesuffix(".__init__"): rel for rel in _repo_files()
            if rel.startswith("benchmarks/")}
    graph = {}
    for mod, rel in rels.items():
        found = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, rel)).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import submodule`` is an edge to the submodule
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in rels else node.module
                         for a in node.names]
            for n in names:
                if n.startswith("benchmarks"):
                    found.add(n)
                elif n.split(".")[0] in BARE_BENCH:
                    found.add("benchmarks." + n.split(".")[0])
        graph[mod] = found - {mod}
    assert len(graph) > 20, "the harness was not found"
    cycles = _cycles(graph)
    assert cycles == [], cycles


def test_the_cycle_search_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _room_of_import("benchmarks.harness.compare", "tools/x.py") == 3
    assert _room_of_import("compare", "benchmarks/x.py") == 3 and _room_of_import("numpy", "tools/x.py") is None
