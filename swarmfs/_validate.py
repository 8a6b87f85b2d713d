"""The argument rules: one parser per kind of value, one error class per rule.

As zarr's ``core/common.py`` (``parse_bool``, ``parse_shapelike``,
``parse_enum``), every public entry point checks its arguments here, so a
bad value of one kind raises one class whichever entry point it reached:

========================  =====================================  ===========================
rule                      accepts                                raises
========================  =====================================  ===========================
:func:`parse_bool`        ``True``, ``False``, numpy bools       :class:`InvalidBoolError`
:func:`parse_int`         integers (not bools) in [lo, hi]       :class:`InvalidIntegerError`
:func:`parse_number`      finite reals (not bools) in a range    :class:`InvalidNumberError`
:func:`parse_ratio`       a real number in (0, 1]                :class:`InvalidRatioError`
:func:`parse_fraction`    a real number in [0, 1]                :class:`InvalidFractionError`
:func:`parse_choice`      one of a fixed set of values           :class:`InvalidChoiceError`
:func:`parse_dtype`       a dtype name of a fixed set            :class:`InvalidDtypeError`
:func:`parse_path`        ``str`` or ``os.PathLike``, no NUL     :class:`InvalidPathError`
:func:`parse_instance`    an instance of given classes           :class:`InvalidTypeError`
:func:`parse_callable`    anything callable                      :class:`InvalidTypeError`
:func:`parse_index`       an integer index (layer, cluster)      :class:`InvalidIndexError`
:func:`parse_indices`     a 1-D integer array of indices         :class:`InvalidIndexError`
:func:`checked`           a call its signature binds             :class:`InvalidCallError`
========================  =====================================  ===========================

Every error is an :class:`~swarmfs.InvalidArgumentError` (so a ``ValueError``
and a ``TypeError``) naming the argument (its ``argument`` attribute and its
message) and the context passed as ``where`` (store, layer, ...).  None is
never accepted by a rule: an optional argument is checked by the caller as
``None if x is None else parse_...(x, ...)``.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import reprlib

import numpy as np

from . import _errors as errors

__all__ = ["parse_bool", "parse_int", "parse_positive_int", "parse_nonneg_int",
           "parse_number", "parse_ratio", "parse_fraction", "parse_choice", "parse_dtype",
           "parse_path", "parse_instance", "parse_callable", "parse_index", "parse_indices",
           "checked", "checked_methods"]

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


def _got(x) -> str:
    return _repr.repr(x)


def parse_bool(x, name: str, **where) -> bool:
    """``x`` as a Python bool; only True, False and numpy bools pass (not 0,
    1 or "yes": a flag given a count is a mistake, not a wish).

    Raises:
        InvalidBoolError: naming ``name`` and the context in ``where``.
    """
    if not isinstance(x, (bool, np.bool_)):
        raise errors.InvalidBoolError(f"{name} must be True or False, got {_got(x)}",
                                      argument=name, **where)
    return bool(x)


def parse_int(x, name: str, lo: int | None = None, hi: int | None = None, **where) -> int:
    """``x`` as a Python int in ``[lo, hi]`` (a bound of None is open).
    Python and numpy integers pass; bools, floats (even 3.0) and strings do
    not (no silent truncation).

    Raises:
        InvalidIntegerError: naming ``name``, the range and the context.
    """
    ok = not isinstance(x, (bool, np.bool_)) and isinstance(x, numbers.Integral)
    if ok:
        x = int(x)
        ok = (lo is None or x >= lo) and (hi is None or x <= hi)
    if not ok:
        rng = (f" in [{lo}, {hi}]" if lo is not None and hi is not None else
               f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else "")
        raise errors.InvalidIntegerError(f"{name} must be an integer{rng}, got {_got(x)}",
                                         argument=name, **where)
    return x


def parse_positive_int(x, name: str, hi: int | None = None, **where) -> int:
    """:func:`parse_int` with ``lo=1`` (counts, sizes, batch lengths)."""
    return parse_int(x, name, 1, hi, **where)


def parse_nonneg_int(x, name: str, hi: int | None = None, **where) -> int:
    """:func:`parse_int` with ``lo=0`` (windows, gaps, byte budgets)."""
    return parse_int(x, name, 0, hi, **where)


def _real(x) -> float | None:
    """``x`` as a finite float, or None (bools, non-reals, NaN, inf)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def parse_number(x, name: str, lo: float | None = None, hi: float | None = None, *,
                 lo_open: bool = False, hi_open: bool = False, unit: str = "",
                 **where) -> float:
    """``x`` as a finite float in the range from ``lo`` to ``hi`` (closed
    ends unless ``lo_open``/``hi_open``; None: unbounded).  Python and numpy
    reals pass; bools, NaN, infinities and strings do not.

    Raises:
        InvalidNumberError: naming ``name`` (with ``unit``), the range and
            the context.
    """
    v = _real(x)
    ok = v is not None and \
        (lo is None or (v > lo if lo_open else v >= lo)) and \
        (hi is None or (v < hi if hi_open else v <= hi))
    if not ok or v is None:
        rng = ""
        if lo is not None and hi is not None:
            rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            rng = f" {'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            rng = f" {'<' if hi_open else '<='} {hi:g}"
        what = f"{name} ({unit})" if unit else name
        raise errors.InvalidNumberError(f"{what} must be a finite number{rng}, got {_got(x)}",
                                        argument=name, **where)
    return v


def parse_ratio(x, name: str, **where) -> float:
    """``x`` as a float in (0, 1]: the sparsity ratio r, a clustering radius
    tau (SWARM §5.1, §6.2, §8.1).

    Raises:
        InvalidRatioError: naming ``name`` and the context.
    """
    v = _real(x)
    if v is None or not 0 < v <= 1:
        raise errors.InvalidRatioError(f"{name} must be a number in (0, 1], got {_got(x)}",
                                       argument=name, **where)
    return v


def parse_fraction(x, name: str, **where) -> float:
    """``x`` as a float in [0, 1]: a share of a budget (hot fraction, depth).

    Raises:
        InvalidFractionError: naming ``name`` and the context.
    """
    v = _real(x)
    if v is None or not 0 <= v <= 1:
        raise errors.InvalidFractionError(f"{name} must be a number in [0, 1], got {_got(x)}",
                                          argument=name, **where)
    return v


def parse_choice(x, name: str, choices, **where):
    """The one of ``choices`` that ``x`` equals (``==``; a bool never equals
    a number, an array or unhashable value is simply not one of them).

    Raises:
        InvalidChoiceError: naming ``name``, the choices and the context.
    """
    for c in choices:
        if _same(x, c):
            return c
    shown = ", ".join(repr(c) for c in choices)
    raise errors.InvalidChoiceError(f"{name} must be one of {shown}; got {_got(x)}",
                                    argument=name, **where)


def _same(x, c) -> bool:
    """``x == c`` as a plain bool; False for a bool against a non-bool
    (True == 1) and for a comparison that is not a truth value (arrays)."""
    if isinstance(x, (bool, np.bool_)) != isinstance(c, bool):
        return False
    try:
        eq = x == c
    except Exception:           # a value whose __eq__ raises is not a choice
        return False
    return isinstance(eq, (bool, np.bool_)) and bool(eq)


def parse_dtype(x, name: str, dtypes, **where) -> str:
    """``x`` as a dtype name, one of ``dtypes`` (e.g. ``"float16"``,
    ``"bfloat16"``, ``"float32"``); a numpy dtype or type is taken by its name.

    Raises:
        InvalidDtypeError: naming ``name``, the dtypes and the context.
    """
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        x = np.dtype(x).name
    if not isinstance(x, str) or x not in dtypes:
        raise errors.InvalidDtypeError(f"{name} must be one of {sorted(dtypes)}, got {_got(x)}",
                                       argument=name, **where)
    return x


def parse_path(x, name: str, **where) -> str:
    """``x`` as a non-empty path string (``str`` or ``os.PathLike`` of
    ``str``); bytes, numbers, an empty string or a NUL byte are refused.

    Raises:
        InvalidPathError: naming ``name`` and the context.
    """
    p = x
    if isinstance(x, os.PathLike):
        p = os.fspath(x)
    if not isinstance(p, str) or not p or "\0" in p:
        raise errors.InvalidPathError(f"{name} must be a non-empty path without NUL bytes, "
                                      f"got {_got(x)}", argument=name, **where)
    return p


def parse_instance(x, name: str, types, **where):
    """``x`` if it is an instance of ``types`` (a class or a tuple of them).

    Raises:
        InvalidTypeError: naming ``name``, the classes and the context.
    """
    if not isinstance(x, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple)
                                                 else (types,)))
        raise errors.InvalidTypeError(f"{name} must be a {want}, got {type(x).__name__}",
                                      argument=name, **where)
    return x


def parse_callable(x, name: str, **where):
    """``x`` if it is callable.

    Raises:
        InvalidTypeError: naming ``name`` and the context.
    """
    if not callable(x):
        raise errors.InvalidTypeError(f"{name} must be callable, got {type(x).__name__}",
                                      argument=name, **where)
    return x


def parse_index(x, name: str, **where) -> int:
    """``x`` as a Python int index (a layer, cluster or token number); bools,
    floats, None and strings are refused (a bool or float would otherwise
    find another key).  The range is the caller's: it knows the store.

    Raises:
        InvalidIndexError: naming ``name`` and the context (it is also an
            :class:`~swarmfs.OutOfRangeError`).
    """
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise errors.InvalidIndexError(f"{name} must be an integer, got {_got(x)}",
                                       argument=name, **where)
    return int(x)


def parse_indices(x, name: str, **where) -> np.ndarray:
    """``x`` as a 1-D int64 numpy array of indices; an empty list is fine,
    bools and floats are refused (no silent truncation).

    Raises:
        InvalidIndexError: naming ``name`` and the context.
    """
    a = np.asarray(x)
    if a.size == 0:
        return np.empty(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise errors.InvalidIndexError(f"{name} must be integers, got {a.dtype}",
                                       argument=name, **where)
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.max() > np.iinfo(np.int64).max:
        raise errors.InvalidIndexError(f"{name} holds a value beyond int64", argument=name,
                                       **where)
    return a.astype(np.int64, copy=False).reshape(-1)


# -- the call rule ----------------------------------------------------------------

def checked(fn):
    """Decorator of a public function or method: a call its signature does
    not bind (an unknown keyword argument, a missing or extra positional one)
    raises :class:`InvalidCallError` naming the function and the argument,
    not a bare ``TypeError``.  A ``TypeError`` raised inside ``fn`` passes
    unchanged; the check costs nothing on a call that binds.
    """
    if getattr(fn, errors.CHECKED, False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        try:
            return fn(*args, **kw)
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
                raise errors.call_error(fn, exc) from None
            raise
    setattr(wrapper, errors.CHECKED, True)
    return wrapper


def checked_methods(cls):
    """Class decorator: :func:`checked` on ``__init__`` and on every public
    method (plain, class and static) the class defines itself.  Methods
    already checked (``errors.boundary`` checks its calls too) and properties
    are left as they are."""
    for name, attr in list(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            fn = attr.__func__
            if inspect.isfunction(fn) and not getattr(fn, errors.CHECKED, False):
                setattr(cls, name, type(attr)(checked(fn)))
        elif inspect.isfunction(attr) and not getattr(attr, errors.CHECKED, False):
            setattr(cls, name, checked(attr))
    return cls
