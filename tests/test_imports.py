"""The import graph of ``swarmfs``: no cycle, and the runtime does not build on the layout.

The graph is read from the source (``ast``), so imports inside functions count
as much as module-level ones: a cycle broken only by a function-level import
is still a cycle to a reader.  ``swarmfs.layout`` is installed from ``layout/``
(``pyproject.toml``: package-dir), so modules are located through the import
system (``importlib.util.find_spec``), not by walking one folder.
"""

from __future__ import annotations

import ast
import importlib.util

import pytest

ROOT = "swarmfs"

#: Modules that drive whole pipelines (capture -> layout -> store -> decode)
#: and may therefore call the offline layout.  Everything else in the runtime
#: is below the layout: the layout builds on it, never the other way round.
PIPELINES = {"swarmfs._cli", "swarmfs._demo", "swarmfs._generate", "swarmfs.hf",
             "swarmfs.hf._cache"}


def _is_package(spec) -> bool:
    return spec.submodule_search_locations is not None


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):     # ValueError: cffi's lib object
        return False


def from_target(pkg: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` in package ``pkg`` names."""
    if not node.level:
        return node.module or ""
    base = pkg
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def imports_of(name: str, source: str, is_package: bool) -> set[str]:
    """Absolute names of the modules a module's source imports, anywhere in it
    (module level, functions, classes, conditionals).  ``from X import a``
    names ``X.a`` when that is a module, else ``X``."""
    pkg = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = from_target(pkg, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if a.name != "*" and sub.startswith(ROOT + ".") and
                        _module_exists(sub) else target)
    return out


def module_graph(root: str = ROOT) -> dict[str, set[str]]:
    """{module: modules of ``root`` it imports}, for every module reachable
    from ``root``, the packages holding them and every module file of each
    package found on the way.  A package is not an edge of its submodules (it
    is a node of its own, whose edges are what its ``__init__`` imports)."""
    graph: dict[str, set[str]] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in graph:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            graph[name] = set()                  # the compiled engine, a namespace
            continue
        with open(spec.origin, encoding="utf-8") as f:
            deps = imports_of(name, f.read(), _is_package(spec))
        graph[name] = {d for d in deps if d == root or d.startswith(root + ".")} - {name}
        todo.extend(graph[name])
        if "." in name:                          # its package runs first: a node too
            todo.append(name.rpartition(".")[0])
        if _is_package(spec):                    # every module of the package
            import pkgutil
            todo.extend(m.name for m in pkgutil.iter_modules(
                spec.submodule_search_locations, name + "."))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None if it is acyclic
    (iterative depth-first search, colours white/grey/black)."""
    colour = dict.fromkeys(graph, 0)
    for start in sorted(graph):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt, 0) == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt, 0) == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
    return None


@pytest.fixture(scope="module")
def graph():
    return module_graph()


def test_graph_covers_runtime_and_layout(graph):
    # the checker really read the tree: both packages, with their known edges
    for mod in ("swarmfs.decode._retrieve", "swarmfs.decode._selectors", "swarmfs.store._store",
                "swarmfs.layout._quality", "swarmfs.layout._baselines",
                "swarmfs.store._placement", "swarmfs.layout._layer", "swarmfs._validate"):
        assert mod in graph, mod
    assert "swarmfs.decode._selectors" in graph["swarmfs.decode._retrieve"]
    assert "swarmfs.store._placement" in graph["swarmfs.store._index"]
    assert "swarmfs.store._placement" in graph["swarmfs.layout"]
    assert "swarmfs.layout._layer" in graph["swarmfs.hf._cache"]
    assert "swarmfs._errors" in graph["swarmfs._validate"]
    # a function-level import is an edge (swarmfs._cli imports _store inside commands)
    assert "swarmfs.store._store" in graph["swarmfs._cli"]


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_checker_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    # a cycle away from the first node, reached through a diamond
    g = {"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": {"e"}, "e": {"d"}}
    assert find_cycle(g) == ["d", "e", "d"]


def test_function_level_import_counts():
    # the Retriever <-> selector cycle of issue 12, written as it was
    src_r = "from ._selectors import MedoidSelector\n"
    src_s = "def f():\n    from ._retrieve import Retriever\n    return Retriever\n"
    g = {"swarmfs._r": {d.replace("_retrieve", "_r").replace("_selectors", "_s")
                        for d in imports_of("swarmfs._r", src_r, False)},
         "swarmfs._s": {d.replace("_retrieve", "_r").replace("_selectors", "_s")
                        for d in imports_of("swarmfs._s", src_s, False)}}
    assert find_cycle(g) == ["swarmfs._r", "swarmfs._s", "swarmfs._r"]


def test_relative_imports_resolve():
    assert imports_of("swarmfs.layout._x", "from .._errors import E\nfrom . import _cluster\n"
                      "from ._profile import p\n", False) == \
        {"swarmfs._errors", "swarmfs.layout._cluster", "swarmfs.layout._profile"}
    assert imports_of("swarmfs", "from ._store import Store\n", True) == {"swarmfs._store"}


def test_runtime_does_not_import_layout(graph):
    bad = {}
    for mod, deps in graph.items():
        if mod.startswith("swarmfs.layout") or mod in PIPELINES:
            continue
        up = {d for d in deps if d == "swarmfs.layout" or d.startswith("swarmfs.layout.")}
        if up:
            bad[mod] = sorted(up)
    assert not bad, f"runtime modules import the offline layout: {bad}"


# -- names come from the module that defines them ---------------------------------

#: the project's packages: a ``from X import n`` of one of their modules is checked
PROJECT = ("swarmfs", "tools")


def top_level_names(source: str) -> set[str]:
    """Names a module's own code binds at module level (def, class,
    assignment, ``for``/``with`` targets, also inside module-level ``if`` /
    ``try``), not the names it imports."""
    out = set()

    def targets(t):
        if isinstance(t, ast.Name):
            out.add(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)

    def walk(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets(node.target)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
                if isinstance(node, ast.For):
                    targets(node.target)
                for part in ("body", "orelse", "finalbody"):
                    walk(getattr(node, part, []))
                for h in getattr(node, "handlers", []):
                    walk(h.body)
    walk(ast.parse(source).body)
    return out


def _exported(module: str) -> tuple[set[str], set[str]] | None:
    """(names ``module`` defines, names its ``__all__`` lists), from its source;
    None for a module that is not Python source (the compiled engine)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        src = f.read()
    tree = ast.parse(src)
    listed = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            listed = set(ast.literal_eval(node.value))
    return top_level_names(src), listed


def borrowed_imports(name: str, source: str, is_package: bool) -> list[str]:
    """``from X import n`` lines of ``source`` whose ``n`` the project module X
    neither defines nor lists in ``__all__``: X only imported it (a hidden
    re-export).  A submodule (``from swarmfs import _errors``) is fine."""
    pkg = name if is_package else name.rpartition(".")[0]
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = from_target(pkg, node)
        if target.split(".")[0] not in PROJECT or not _module_exists(target):
            continue
        known = _exported(target)
        if known is None:
            continue
        defined, listed = known
        for a in node.names:
            if a.name == "*" or a.name in defined or a.name in listed or \
                    _module_exists(f"{target}.{a.name}"):
                continue
            bad.append(f"{name}:{node.lineno}: {a.name} from {target}")
    return bad


def _project_sources():
    """(module name, path, is package) of every Python file of swarmfs,
    layout, tools and tests."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    for top, mod in (("swarmfs", "swarmfs"), ("layout", "swarmfs.layout"),
                     ("tools", "tools"), ("tests", "tests")):
        for p in sorted((root / top).rglob("*.py")):
            rel = p.relative_to(root / top).with_suffix("").parts
            pkg = rel[-1] == "__init__"
            yield ".".join((mod,) + (rel[:-1] if pkg else rel)), p, pkg


@pytest.mark.slow
def test_names_are_imported_from_their_module():
    bad = []
    for name, path, pkg in _project_sources():
        bad += borrowed_imports(name, path.read_text(encoding="utf-8"), pkg)
    assert not bad, "imports of a name from a module that only imports it:\n" + "\n".join(bad)


def test_borrowed_import_checker():
    # window_size is defined in swarmfs.decode._window; swarmfs.decode._selectors only uses it
    assert borrowed_imports("tests.t", "from swarmfs.decode._selectors import window_size\n",
                            False) == ["tests.t:1: window_size from swarmfs.decode._selectors"]
    assert borrowed_imports("swarmfs.decode._x", "from ._retrieve import score_medoids\n",
                            False) == \
        ["swarmfs.decode._x:1: score_medoids from swarmfs.decode._retrieve"]
    ok = ("from swarmfs.decode._window import window_size\n"   # defined there
          "from swarmfs import Store\n"                  # listed in swarmfs.__all__
          "from swarmfs import _errors\n"                # a submodule
          "from swarmfs.layout import place_clusters\n"          # a documented re-export
          "import numpy as np\nfrom numpy import ndarray\n")     # not the project's
    assert borrowed_imports("tests.t", ok, False) == []
    assert top_level_names("a = 1\nif x:\n    def f(): pass\nelse:\n    class C: pass\n"
                           "try:\n    b, (c, d) = 1, (2, 3)\nexcept E:\n    e: int = 0\n"
                           "import g\nfrom h import i\n") == {"a", "f", "C", "b", "c", "d", "e"}
