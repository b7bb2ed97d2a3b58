"""Imports only point down the layers. Every import in every module, including those inside
functions and under ``TYPE_CHECKING``, is checked against this order (bottom first):

    transfer   moves tensors named by a transfer id; imports nothing from pd
    pd.core    the request and its status, batch, attention interface, KV pool, wire messages
    pd.model   the decoder and its model families, loaders, weight formats, tokenizer
    pd.cache   the radix tree and cache, the coordinator's mirror of it
    pd.executor  the engine config, the runner, compiled graphs, attention backends and their
               kernel, the sampler (penalties, grammar masks, speculative verification), the
               host tier's pool
    pd.parallel  tensor parallel: the group and its collectives, the plan, the rank
               processes, the KV copies between ranks, a rank's entry point
    pd.engine  the step loop: scheduler, slots, drafter, engine core, stats, colocated engine
    pd.node    the node: its loop and parts (server link, peers, transfer, heartbeats)
    prefill, decode   the two roles; they never import each other
    pd.router  the coordinator, its route policy, pull costing, the route log: plain Python, no
               sockets, no Ray
    pd.cluster the server's request plane: the cluster client, its flights, sockets, liveness,
               cache-mirror sync, event loop
    pd.fleet   the Ray lifecycle: launcher, node actors, pools, placement, autoscaler, admin
    pd.server  the HTTP server: its core (app, state, checks, generation, routes/), the OpenAI
               surface (``pd.server.openai``) and the HTTP shell (``pd.server.http``)
    pd.cli     the command line
    pdtools    the libraries of scripts/ (benchmarks, the chaos soak, the netns harness): tools
               over the runtime, which never imports them

Inside a room (a top folder: ``pd.server`` with its sub-rooms, ``pd.engine``, ``prefill``, ...)
no import circle may close, counting function-local and type-only imports too
(``test_no_new_import_circle_inside_a_room``). And every room stays small enough to read as one
(``test_rooms_stay_readable``): at most 15 modules in a folder of ``pd/``, 400 lines in a
module, 20 methods in a class.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (package, layer): a module may import its own package and packages of lower layers.
LAYERS: list[tuple[str, int]] = [
    ("transfer", 0),
    ("pd.core", 1),
    ("pd.model", 2),
    ("pd.cache", 3),
    ("pd.executor", 4),
    ("pd.parallel", 5),
    ("pd.engine", 6),
    ("pd.node", 7),
    ("prefill", 8),
    ("decode", 8),
    ("pd.router", 9),
    ("pd.cluster", 10),
    ("pd.fleet", 11),
    ("pd.server", 12),
    ("pd.cli", 13),
    ("pdtools", 14),
]


def layer_of(module: str) -> tuple[str, int] | None:
    for package, layer in LAYERS:
        if module == package or module.startswith(package + "."):
            return package, layer
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in the file; ``from a import b`` also yields
    ``a.b`` (b may be a submodule: ``from pd import envs``)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def upward_imports(path: Path, module: str | None = None) -> list[str]:
    """What ``path`` (the module ``module``, by default its own name) imports against the
    layer order, as readable lines."""
    me = layer_of(module or module_name(path))
    if me is None:
        return []
    package, layer = me
    bad = []
    for line, target in imported_modules(path):
        other = layer_of(target)
        if other is None or other[0] == package or other[1] < layer:
            continue
        bad.append(
            f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} imports "
            f"{target} ({other[0]}, layer {other[1]}) from {package} (layer {layer})"
        )
    return bad


def source_files() -> list[Path]:
    return sorted(
        p
        for d in ("pd", "prefill", "decode", "transfer", "pdtools")
        for p in (ROOT / d).rglob("*.py")
    )


def test_every_runtime_module_is_in_a_layer() -> None:
    # pd/__init__.py is the namespace itself; everything else sits in exactly one layer
    loose = [
        str(p.relative_to(ROOT))
        for p in source_files()
        if module_name(p) != "pd" and layer_of(module_name(p)) is None
    ]
    assert loose == [], f"modules outside every layer (add them to LAYERS or move them): {loose}"


def test_imports_only_point_down() -> None:
    bad = [line for p in source_files() for line in upward_imports(p)]
    assert bad == [], "imports that run up the layers:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source", "is_bad"),
    [
        ("pd.cache.x", "from pd.engine.scheduler import Scheduler\n", True),
        ("pd.core.x", "def f():\n    from pd.model import llama\n", True),
        ("prefill.x", "import decode.node\n", True),
        ("transfer.x", "from pd.core import envs\n", True),
        ("pd.engine.x", "from pd import node\n", True),
        ("pd.engine.x", "from pd.cache.base import BasePrefixCache\n", False),
        ("pd.executor.x", "from pd.parallel.group import TPGroup\n", True),
        ("pd.executor.x", "from pd.engine.scheduler import Scheduler\n", True),
        ("pd.parallel.x", "from pd.executor.runner import ModelRunner\n", False),
        ("pd.parallel.x", "from pd.engine.core import EngineCore\n", True),
        ("pd.engine.x", "from pd.parallel.ranks import RankLink\n", False),
        ("pd.fleet.x", "from prefill.node import PrefillRole\n", False),
        ("pd.router.x", "from pd.cluster.client import ClusterClient\n", True),
        ("pd.cluster.x", "from pd.fleet.launcher import Cluster\n", True),
        ("pd.server.x", "from pdtools.bench_client import Result\n", True),
        ("pdtools.x", "from pd.router.coordinator import Coordinator\n", False),
    ],
)
def test_the_check_sees_an_upward_import(
    tmp_path: Path, module: str, source: str, is_bad: bool
) -> None:
    """The checker itself: each deliberately upward import is caught, downward ones pass."""
    fake = tmp_path / "x.py"
    fake.write_text(source)
    assert imported_modules(fake), "the parser found no import"
    assert bool(upward_imports(fake, module)) is is_bad, (module, source)


# Import circles that exist today inside a room, each a set of modules: to be broken (issue 53).
# The test fails on any circle not listed here, and on a listed one that is gone (drop it).
KNOWN_CIRCLES: list[frozenset[str]] = []


def room_of(module: str) -> str:
    """A module's room: its layer's package (``pd.server`` holds its sub-rooms), else its top
    folder."""
    found = layer_of(module)
    return found[0] if found is not None else module.split(".")[0]


def import_edges(path: Path, modules: Iterable[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, anywhere in it (function-local and
    ``TYPE_CHECKING`` imports included): ``from a import b`` is an edge to ``a.b`` when that is
    a module, else to ``a``; an import of a name inside a module is an edge to that module."""
    known = set(modules)
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                add(sub if sub in known else node.module)
    return found


def circles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def room_circles() -> list[frozenset[str]]:
    modules = {module_name(p): p for p in source_files()}
    graph = {
        name: {
            other
            for other in import_edges(path, modules)
            if other != name and room_of(other) == room_of(name)
        }
        for name, path in modules.items()
    }
    return circles(graph)


def test_no_new_import_circle_inside_a_room() -> None:
    found = room_circles()
    new = [sorted(c) for c in found if c not in KNOWN_CIRCLES]
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert new == [], f"import circles inside a room (break them): {new}"
    assert gone == [], f"circles in KNOWN_CIRCLES that no longer close (drop them): {gone}"


def test_the_circle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    assert circles({"a": {"b"}, "b": set()}) == []


MAX_MODULES_PER_FOLDER = 15
MAX_MODULE_LINES = 400
MAX_CLASS_METHODS = 20


def oversized(root: Path) -> list[str]:
    """What under ``root`` passes the limits: a folder's modules (``__init__`` not counted),
    a module's lines, a class's methods (properties and static methods counted)."""
    found = []
    for folder in sorted(p for p in [root, *root.rglob("*")] if p.is_dir()):
        modules = [m for m in folder.glob("*.py") if m.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            found.append(f"{folder.relative_to(root.parent)}/: {len(modules)} modules")
    for module in sorted(root.rglob("*.py")):
        text = module.read_text()
        name = module.relative_to(root.parent)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                defs = (ast.FunctionDef, ast.AsyncFunctionDef)
                methods = sum(isinstance(n, defs) for n in node.body)
                if methods > MAX_CLASS_METHODS:
                    found.append(f"{name}: class {node.name} has {methods} methods")
    return found


def test_rooms_stay_readable() -> None:
    assert oversized(ROOT / "pd") == []


def test_the_size_check_sees_each_limit(tmp_path: Path) -> None:
    room = tmp_path / "pd" / "wide"
    room.mkdir(parents=True)
    for i in range(MAX_MODULES_PER_FOLDER + 1):
        (room / f"m{i}.py").write_text("x = 1\n")
    (room / "m0.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    methods = "".join(f"    def f{i}(self): pass\n" for i in range(MAX_CLASS_METHODS + 1))
    (room / "m1.py").write_text(f"class Big:\n{methods}")
    assert oversized(tmp_path / "pd") == [
        f"pd/wide/: {MAX_MODULES_PER_FOLDER + 1} modules",
        f"pd/wide/m0.py: {MAX_MODULE_LINES + 1} lines",
        f"pd/wide/m1.py: class Big has {MAX_CLASS_METHODS + 1} methods",
    ]
