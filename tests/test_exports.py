"""``__all__`` of every module, as trio's ``_tests/test_exports.py`` checks it.

Walks the ``swarmfs`` package (``swarmfs.layout`` is installed from
``layout/``, so the walk follows each package's ``__path__``) and checks that

* every module has ``__all__`` and every name in it exists;
* nothing private (a leading underscore) is exported;
* every exported class and function has a docstring of its own, and so does
  every public method of an exported class;
* a public module exports exactly its public names: what ``dir()`` shows
  without an underscore, apart from submodules (and, in a module that is not
  a package, names it imports), is in ``__all__``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import swarmfs

#: Modules run as scripts, and the compiled engine (cffi), not Python source.
SCRIPTS = {"swarmfs.__main__", "swarmfs._native"}


def _walk(pkg) -> list[str]:
    names = [pkg.__name__]
    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        if info.name in SCRIPTS:
            continue
        if info.ispkg:
            names += _walk(importlib.import_module(info.name))
        else:
            names.append(info.name)
    return names


def _modules() -> list[str]:
    names = _walk(swarmfs)
    # installed from layout/, beside swarmfs/ rather than inside it: walk it too
    layout = importlib.import_module("swarmfs.layout")
    names += [n for n in _walk(layout) if n not in names]
    return sorted(names)


MODULES = _modules()


def _is_public_module(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def _own_doc(obj) -> str | None:
    """The object's own docstring (a dataclass's generated signature, or one
    inherited from a builtin base, does not count)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if not doc or not doc.strip():
        return None
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return None
    return doc


def test_walk_finds_both_packages():
    for name in ("swarmfs", "swarmfs.layout", "swarmfs.models", "swarmfs.hf",
                 "swarmfs.decode._stages", "swarmfs.layout._cluster", "swarmfs.store._placement"):
        assert name in MODULES, name


@pytest.mark.parametrize("name", MODULES)
def test_module_has_all_and_every_name_exists(name):
    mod = importlib.import_module(name)
    assert hasattr(mod, "__all__"), f"{name} has no __all__"
    assert len(set(mod.__all__)) == len(mod.__all__), f"{name}.__all__ repeats a name"
    missing = [x for x in mod.__all__ if not hasattr(mod, x)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"
    private = [x for x in mod.__all__ if x.startswith("_")]
    assert not private, f"{name} exports private names: {private}"


@pytest.mark.parametrize("name", MODULES)
def test_exported_names_have_docstrings(name):
    mod = importlib.import_module(name)
    bare = []
    for x in getattr(mod, "__all__", ()):
        obj = getattr(mod, x)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue                                   # constants: documented with #:
        if _own_doc(obj) is None:
            bare.append(x)
        if inspect.isclass(obj) and obj.__module__ == name:     # methods: at home
            for m, f in vars(obj).items():
                if m.startswith("_"):
                    continue
                f = getattr(f, "__func__", f)              # static and class methods
                if (isinstance(f, property) or inspect.isfunction(f)) and \
                        not (f.__doc__ or "").strip():
                    bare.append(f"{x}.{m}")
    assert not bare, f"{name}: no docstring on {bare}"


@pytest.mark.parametrize("name", [m for m in MODULES if _is_public_module(m)])
def test_public_package_exports_exactly_its_public_names(name):
    mod = importlib.import_module(name)
    package = hasattr(mod, "__path__")

    def own(x):          # a package re-exports; a module exports what it defines
        obj = getattr(mod, x)
        return package or getattr(obj, "__module__", name) == name
    public = {x for x in dir(mod) if not x.startswith("_") and
              not inspect.ismodule(getattr(mod, x)) and own(x)}
    public -= {"annotations"}                          # from __future__
    assert public == set(mod.__all__), \
        f"{name}: public but not exported {sorted(public - set(mod.__all__))}, " \
        f"exported but not public {sorted(set(mod.__all__) - public)}"


def test_a_wrong_all_fails(monkeypatch):
    # the checks above fail on a module that exports a missing or private name
    import swarmfs.decode._window as w
    monkeypatch.setattr(w, "__all__", [*w.__all__, "nope"])
    with pytest.raises(AssertionError, match="lacks"):
        test_module_has_all_and_every_name_exists("swarmfs.decode._window")
    monkeypatch.setattr(w, "__all__", ["entry_budget", "LOCAL_WINDOW", "_private"])
    with pytest.raises(AssertionError, match="private"):
        test_module_has_all_and_every_name_exists("swarmfs.decode._window")


def test_an_undocumented_export_fails(monkeypatch):
    import swarmfs.decode._window as w

    def bare(x):
        return x
    monkeypatch.setattr(w, "bare", bare, raising=False)
    monkeypatch.setattr(w, "__all__", [*w.__all__, "bare"])
    with pytest.raises(AssertionError, match="bare"):
        test_exported_names_have_docstrings("swarmfs.decode._window")
