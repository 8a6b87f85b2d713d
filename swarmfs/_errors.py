"""Every error swarmfs raises.

All errors derive from :class:`SwarmError`.  Each subclass also inherits the
matching built-in exception, so ``except FileNotFoundError`` or
``except ValueError`` keep working.  Errors carry the context they are about
(store, disk, layer, cluster) as attributes and in their message.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "SwarmError",
    "StoreExistsError",
    "StoreNotFoundError",
    "ManifestError",
    "DiskError",
    "DiskMissingError",
    "DiskMismatchError",
    "DiskTruncatedError",
    "DiskFullError",
    "MisalignedRequestError",
    "OutOfRangeError",
    "ChecksumError",
    "IOFailedError",
    "ShapeError",
    "LayoutError",
    "ModelError",
    "NotFoundError",
    "MountError",
    "ConfigError",
    "InvalidArgumentError",
    "InvalidCallError",
    "InvalidTypeError",
    "InvalidBoolError",
    "InvalidIntegerError",
    "InvalidNumberError",
    "InvalidRatioError",
    "InvalidFractionError",
    "InvalidChoiceError",
    "InvalidDtypeError",
    "InvalidPathError",
    "InvalidIndexError",
    "ConcurrentUseError",
    "InternalError",
]


class SwarmError(Exception):
    """Base class of every swarmfs error.

    Attributes:
        store: store directory the error concerns, or None.
        disk: disk index, or None.
        layer: layer index, or None.
        cluster: cluster id, or None.
        path: the file or disk path, or None.
        offset: byte offset on the disk of the damage itself (the first
            damaged or missing byte), or None.
    """

    def __init__(self, message: str, *, store=None, disk=None, layer=None,
                 cluster=None, path=None, offset=None):
        self.store = str(store) if store is not None else None
        self.disk = disk
        self.layer = layer
        self.cluster = cluster
        self.path = str(path) if path is not None else None
        self.offset = int(offset) if offset is not None else None
        where = []
        if store is not None:
            where.append(f"store {store}")
        if disk is not None:
            where.append(f"disk {disk}" + (f" ({path})" if path is not None else ""))
        elif path is not None:
            where.append(str(path))
        if layer is not None:
            where.append(f"layer {layer}")
        if cluster is not None:
            where.append(f"cluster {cluster}")
        if offset is not None:
            where.append(f"offset {int(offset)}")
        self.message = message
        super().__init__(message + (f" [{', '.join(where)}]" if where else ""))


class StoreExistsError(SwarmError, FileExistsError):
    """Raised by ``Store.create`` when the store directory already holds a store
    (or other files).  Pass ``force=True`` (CLI: ``--force``) to replace it."""


class StoreNotFoundError(SwarmError, FileNotFoundError):
    """Raised when a store directory or its manifest does not exist."""


class ManifestError(SwarmError, ValueError):
    """Raised when a manifest or its index file is unreadable, from an unknown
    format version, fails its checksum, holds a field its format version does
    not have, or is internally inconsistent.  The store must be rebuilt or
    restored; swarmfs never guesses."""


class DiskError(SwarmError, OSError):
    """Base class of errors about one disk of a store."""


class DiskMissingError(DiskError, FileNotFoundError):
    """Raised at open when a disk path listed in the manifest does not exist
    or cannot be opened.  Reattach the disk at its path (``swarmfs info``
    lists them)."""


class DiskMismatchError(DiskError):
    """Raised at open when a disk's superblock is absent, corrupt, from another
    store (UUID differs), or carries another disk index (disks swapped)."""


class DiskTruncatedError(DiskError):
    """Raised when a disk is shorter than the data the manifest places on it,
    at open or when a read hits the end of the disk early."""


class DiskFullError(DiskError):
    """Raised when a write runs out of space on a disk (ENOSPC / EFBIG or the
    disk's capacity).  The manifest still describes the last committed state;
    nothing written by the failed operation becomes visible."""

    def __init__(self, message: str, **kw):
        super().__init__(message, **kw)
        self.errno = _errno.ENOSPC


class MisalignedRequestError(SwarmError, ValueError):
    """Raised before submission when a request's offset, length or buffer
    address is not a multiple of the disk's logical block size (O_DIRECT)."""


class OutOfRangeError(SwarmError, IndexError):
    """Raised for a layer, cluster, token or byte range outside the store."""


class ChecksumError(SwarmError):
    """Raised when bytes read from a disk do not match their stored XXH3-64
    checksum.  ``swarmfs verify`` names every bad extent."""


class IOFailedError(SwarmError, OSError):
    """Raised when the kernel fails a request (the -errno is in ``errno``)."""

    def __init__(self, message: str, *, errno: int | None = None, **kw):
        super().__init__(message, **kw)
        self.errno = errno


#: attribute set on a function whose calls are checked against its signature
#: (``_validate.checked`` and :func:`boundary`)
CHECKED = "__swarmfs_checked__"


def call_error(fn, exc: TypeError) -> InvalidCallError:
    """The :class:`InvalidCallError` of a call of ``fn`` that its signature
    does not bind (``exc`` is the TypeError Python raised binding it), naming
    the function and, where Python names one, the argument."""
    import re
    name = fn.__qualname__
    name = name[:-len(".__init__")] if name.endswith(".__init__") else name
    why = re.sub(r"^[\w.<>]+\(\) ", "", str(exc))     # Python's reason, without its name
    m = re.search(r"'([^']+)'", why)
    return InvalidCallError(f"{name}(): {why}", argument=m.group(1) if m else None)


def boundary(fn):
    """Decorator for public functions: whatever escapes is a SwarmError.

    A call the signature does not bind (an unknown keyword argument, a
    missing one) raises :class:`InvalidCallError`; a SwarmError passes
    unchanged; an ``OSError`` becomes an :class:`IOFailedError` (errno kept);
    any other exception is a bug in swarmfs and becomes an
    :class:`InternalError` naming the function, with the original chained
    (``__cause__``).  ``KeyboardInterrupt`` and other BaseExceptions pass
    unchanged.
    """
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        try:
            return fn(*args, **kw)
        except SwarmError:
            raise
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
                raise call_error(fn, exc) from None    # raised binding the call
            raise InternalError(f"internal error in {fn.__qualname__}: "
                                f"{type(exc).__name__}: {exc}") from exc
        except MemoryError as exc:
            raise InvalidArgumentError(f"{fn.__qualname__}: out of memory (the request "
                                       "is too large)") from exc
        except OSError as exc:
            raise IOFailedError(f"{fn.__qualname__}: {exc.strerror or exc}",
                                errno=exc.errno, path=exc.filename) from exc
        except Exception as exc:
            raise InternalError(f"internal error in {fn.__qualname__}: "
                                f"{type(exc).__name__}: {exc}") from exc
    setattr(wrapper, CHECKED, True)
    return wrapper


class ShapeError(SwarmError, ValueError):
    """Raised when a KV array's shape or dtype does not match the store's model
    shape, or cluster definitions are inconsistent."""


class LayoutError(SwarmError, ValueError):
    """Raised for invalid layout parameters (tau outside (0, 1], a budget
    larger than the context, an empty profile, ...)."""


class ModelError(SwarmError, ValueError):
    """Raised when a model directory is missing, is not a transformer that
    swarmfs can capture, or a text is too short for it."""


class NotFoundError(SwarmError, KeyError):
    """Raised when a named object (layer, cluster, benchmark) does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class MountError(SwarmError, OSError):
    """Raised by ``mount``/``umount`` when the mount point is unusable
    (missing, not a directory, already mounted, a dead FUSE mount), when the
    kernel refuses the mount, or when unmounting fails.  The message says what
    to do (e.g. ``swarmfs umount --lazy MOUNTPOINT``)."""


class ConfigError(SwarmError, ValueError):
    """Raised for an invalid option or environment setting (for example an
    unknown ``SWARMFS_ENGINE`` value).  Fix the setting; nothing was done."""


class InvalidArgumentError(SwarmError, ValueError, TypeError):
    """Raised by a public function for an argument of the wrong type, shape
    or range (a negative count, a NaN ratio, a float where an integer is
    required, ...).  It is both a ``ValueError`` and a ``TypeError``, so
    callers catching either keep working.  Nothing was changed; fix the
    argument.  The subclasses below are one per rule of
    :mod:`swarmfs._validate`.

    Attributes:
        argument: the argument's name, or None.
    """

    def __init__(self, message: str, *, argument: str | None = None, **kw):
        super().__init__(message, **kw)
        self.argument = argument


class InvalidCallError(InvalidArgumentError):
    """Raised when a public function or method is called with arguments its
    signature does not take: an unknown keyword argument, a missing required
    one, too many positional ones.  Names the function and the argument."""


class InvalidTypeError(InvalidArgumentError):
    """Raised for an argument that is not of the class it must be (a Store, a
    Retrieval, a callable)."""


class InvalidBoolError(InvalidArgumentError):
    """Raised for a flag that is not True or False (0, 1, "yes" and None are
    refused)."""


class InvalidIntegerError(InvalidArgumentError):
    """Raised for a count, size or byte length that is not an integer (a
    bool, a float, a string) or lies outside its range."""


class InvalidNumberError(InvalidArgumentError):
    """Raised for a real-valued argument (a latency, a scale) that is not a
    finite number or lies outside its range."""


class InvalidRatioError(InvalidArgumentError):
    """Raised for a ratio outside (0, 1]: the sparsity ratio r, a clustering
    radius tau.  The same class at every entry point (``Retriever``,
    ``SwarmCache``, ``swarmfs.layout``, the CLI)."""


class InvalidFractionError(InvalidArgumentError):
    """Raised for a share outside [0, 1] (a hot-cluster DRAM fraction)."""


class InvalidChoiceError(InvalidArgumentError):
    """Raised for a value that is not one of its fixed set (a policy, a
    method, a metric, a score); the message lists the choices."""


class InvalidDtypeError(InvalidArgumentError):
    """Raised for a dtype name that is not one of the supported ones."""


class InvalidPathError(InvalidArgumentError):
    """Raised for a path that is not a non-empty ``str`` or ``os.PathLike``
    without NUL bytes."""


class InvalidIndexError(OutOfRangeError, InvalidArgumentError):
    """Raised for a layer, cluster or token number (or an array of them) that
    is not an integer.  Also an :class:`OutOfRangeError`, as an index outside
    the store is."""


class ConcurrentUseError(SwarmError, RuntimeError):
    """Raised when an object is used from more threads at once than its
    concurrency contract allows (for example two threads calling
    ``DecodeSession.step`` for one layer).  The call did nothing; serialise
    the callers."""


class InternalError(SwarmError, RuntimeError):
    """Raised when swarmfs itself broke an invariant (a bug, not the user's
    input or a damaged store).  The CLI reports it with a traceback hint and
    exit status 3; please report it."""
