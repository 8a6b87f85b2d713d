"""Checked option types shared by the tools' click commands.

A count, size, ratio or list that makes no sense (``--repeats 0``,
``--cases -5``, ``--tokens abc``, ``--sizes 4Q``) is a usage error (exit
status 2, click's one-line message naming the option) when the command line
is parsed, before any work starts, never a traceback minutes later.  An
output path that cannot be written (a directory, a device, a parent that is
a file or not writable) is refused the same way, before the run whose
result it would hold.  ``tests/test_tools.py`` checks that every numeric
option of every tool has a range.
"""

from __future__ import annotations

import os
import pathlib
import re

import click

from swarmfs._cli import FiniteFloat

__all__ = ["FiniteFloat", "COUNT", "NONNEG", "POSITIVE", "NONNEG_FLOAT", "RATIO", "FRACTION",
           "DISKS", "QUEUE_DEPTH", "CommaList", "OutPath", "DiskSpec", "MethodRatio",
           "clear_store_dir"]

#: a count of things or repetitions: >= 1
COUNT = click.IntRange(min=1)
#: an offset, seed-like index or optional count: >= 0
NONNEG = click.IntRange(min=0)
#: seconds, a coverage factor, a size: > 0
POSITIVE = FiniteFloat(min=0, min_open=True)
#: seconds that may be 0
NONNEG_FLOAT = FiniteFloat(min=0)
#: the sparsity ratio r: (0, 1]
RATIO = FiniteFloat(0, 1, min_open=True)
#: a share: [0, 1]
FRACTION = FiniteFloat(0, 1)
#: disks of one store (Store.create takes 1 to 256)
DISKS = click.IntRange(1, 256)
#: an engine queue depth (Engine takes 1 to 32768)
QUEUE_DEPTH = click.IntRange(1, 32768)


class CommaList(click.ParamType):
    """A comma-separated list of ``of`` values (empty items skipped; at
    least one value), each checked by ``item`` (a click type such as
    :data:`COUNT`) or one of ``choices``.  With ``keep_text`` the checked
    text itself is the value (for commands that split it later)."""
    name = "list"

    def __init__(self, of=str, *, item: click.ParamType | None = None,
                 choices=None, upper: bool = False, keep_text: bool = False):
        self.of, self.item, self.choices, self.upper = of, item, choices, upper
        self.keep_text = keep_text

    def convert(self, value, param, ctx):
        if not isinstance(value, str):        # a default given as a list
            return value
        out = []
        for x in (v.strip() for v in value.split(",")):
            if not x:
                continue
            if self.upper:
                x = x.upper()
            if self.choices is not None and x not in self.choices:
                self.fail(f"{x!r} in {value!r} is not one of "
                          f"{', '.join(self.choices)}", param, ctx)
            try:
                v = self.of(x)
            except ValueError:
                self.fail(f"{value!r} is not a comma list of {self.of.__name__}s", param, ctx)
            if self.item is not None:
                try:
                    v = self.item.convert(v, param, ctx)
                except click.BadParameter as exc:
                    self.fail(f"{x!r} in {value!r}: {exc.message}", param, ctx)
            out.append(v)
        if not out:
            self.fail(f"{value!r} holds no value", param, ctx)
        return value if self.keep_text else out


class OutPath(click.ParamType):
    """A file (or, with ``prefix``, a prefix that gets suffixes) a tool
    writes when it ends: refused at parse time when it could not be
    written: a directory (unless ``prefix``), an existing non-regular file,
    a parent that is not a directory or not writable.  Missing parent
    directories are allowed (the tools create them).  Converts to ``str``
    or, with ``path=True``, a :class:`pathlib.Path`.

    ``suffixes`` (with ``prefix``): the suffixes the tool appends to the
    prefix (``".json"``, ``".png"``).  A value that already ends in one of
    them loses it, so ``--out X.json`` writes ``X.json`` (and ``X.png``),
    not ``X.json.json``."""
    name = "path"

    def __init__(self, *, prefix: bool = False, path: bool = False, suffixes=()):
        self.prefix, self.path = prefix, path
        self.suffixes = tuple(suffixes)

    def convert(self, value, param, ctx):
        if isinstance(value, pathlib.Path) and self.path or isinstance(value, (str, pathlib.Path)):
            raw = str(value)
        else:
            self.fail(f"{value!r} is not a path", param, ctx)
        if not raw or "\0" in raw:
            self.fail(f"{raw!r} is not a path", param, ctx)
        if self.prefix:
            for suffix in self.suffixes:
                if raw.endswith(suffix) and os.path.basename(raw) != suffix:
                    raw = raw[:-len(suffix)]
                    break
        p = pathlib.Path(raw)
        if not self.prefix and p.is_dir():
            self.fail(f"{raw} is a directory; give a file path", param, ctx)
        if not self.prefix and p.exists() and not p.is_file():
            self.fail(f"{raw} exists and is not a regular file", param, ctx)
        parent = p.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            self.fail(f"{parent} is not a directory", param, ctx)
        if not os.access(parent, os.W_OK | os.X_OK):
            self.fail(f"directory {parent} is not writable", param, ctx)
        return p if self.path else raw


class DiskSpec(click.ParamType):
    """A figure's ``--disks``: ``testbed``, ``testbed:NAME``, ``files:N``
    (N in [1, 256]) or a comma list of devices/files.  A list item that
    does not exist and looks like a mistyped form (``8``, ``file:2``) is
    refused: it would otherwise become a new file of that name used as the
    one disk."""
    name = "spec"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        if value == "testbed" or re.fullmatch(r"testbed:[A-Za-z0-9_.-]+", value):
            return value
        if value.startswith("files:"):
            n = value.split(":", 1)[1]
            if not n.isdigit() or not 1 <= int(n) <= 256:
                self.fail(f"{value!r}: files:N takes N in [1, 256]", param, ctx)
            return value
        items = [p for p in value.split(",") if p]
        if not items:
            self.fail(f"{value!r} names no disk", param, ctx)
        for p in items:
            if os.path.exists(p):
                continue
            if p.isdigit():
                self.fail(f"{p!r} is not a disk; for {p} file disks give files:{p}",
                          param, ctx)
            if re.match(r"[A-Za-z]+:", p):
                self.fail(f"{p!r} is neither testbed[:NAME], files:N nor an existing path",
                          param, ctx)
        return value


def clear_store_dir(path, *, option: str = "ROOT") -> None:
    """Remove ``path`` so a tool can create a store there, but only when it
    is missing, empty, or a swarmfs store (has ``manifest.json``: a store an
    earlier run left); anything else is the user's data, and the tool stops
    with a usage error naming ``option`` instead of deleting it."""
    import shutil
    p = pathlib.Path(path)
    if not os.path.lexists(p):
        return
    if p.is_symlink() or not p.is_dir():
        raise click.BadParameter(f"{p} exists and is not a directory", param_hint=option)
    if any(p.iterdir()) and not (p / "manifest.json").is_file():
        raise click.BadParameter(f"{p} is not empty and not a swarmfs store; the tool "
                                 "deletes and rewrites this directory, so give a new or "
                                 "empty one", param_hint=option)
    shutil.rmtree(p)


class MethodRatio(click.ParamType):
    """``METHOD@R``: a decode method and its sparsity ratio r in (0, 1]."""
    name = "METHOD@R"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        m, sep, r = str(value).partition("@")
        if not sep or m not in ("swarm", "quest", "infllm", "pqcache"):
            self.fail(f"{value!r}: give swarm, quest, infllm or pqcache, then @ and r", param,
                      ctx)
        try:
            ratio = float(r)
        except ValueError:
            ratio = -1.0
        if not 0 < ratio <= 1:
            self.fail(f"{value!r}: r must be a number in (0, 1]", param, ctx)
        return m, ratio
