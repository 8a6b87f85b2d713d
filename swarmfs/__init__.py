"""swarmfs: a co-activation-aware KV-cache store striped over several SSDs.

An implementation of SWARM (FAST 2026).  The public API:

* :class:`Store` -- create/open a store, write layers, read clusters and
  entries with batched io_uring reads.
* :func:`plan_reads` / :class:`Plan` -- the pure read planner (SWARM §6.1).
* :class:`Engine` -- the batched io_uring (or thread-pool) I/O engine.
* errors: :class:`SwarmError` and its subclasses.
"""

from ._errors import ChecksumError as ChecksumError
from ._errors import ConcurrentUseError as ConcurrentUseError
from ._errors import ConfigError as ConfigError
from ._errors import DiskError as DiskError
from ._errors import DiskFullError as DiskFullError
from ._errors import DiskMismatchError as DiskMismatchError
from ._errors import DiskMissingError as DiskMissingError
from ._errors import DiskTruncatedError as DiskTruncatedError
from ._errors import InternalError as InternalError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import InvalidBoolError as InvalidBoolError
from ._errors import InvalidCallError as InvalidCallError
from ._errors import InvalidChoiceError as InvalidChoiceError
from ._errors import InvalidDtypeError as InvalidDtypeError
from ._errors import InvalidFractionError as InvalidFractionError
from ._errors import InvalidIndexError as InvalidIndexError
from ._errors import InvalidIntegerError as InvalidIntegerError
from ._errors import InvalidNumberError as InvalidNumberError
from ._errors import InvalidPathError as InvalidPathError
from ._errors import InvalidRatioError as InvalidRatioError
from ._errors import InvalidTypeError as InvalidTypeError
from ._errors import IOFailedError as IOFailedError
from ._errors import LayoutError as LayoutError
from ._errors import ManifestError as ManifestError
from ._errors import MisalignedRequestError as MisalignedRequestError
from ._errors import ModelError as ModelError
from ._errors import MountError as MountError
from ._errors import NotFoundError as NotFoundError
from ._errors import OutOfRangeError as OutOfRangeError
from ._errors import ShapeError as ShapeError
from ._errors import StoreExistsError as StoreExistsError
from ._errors import StoreNotFoundError as StoreNotFoundError
from ._errors import SwarmError as SwarmError
from .decode._online import DecodeSession as DecodeSession
from .decode._online import PipelinedStep as PipelinedStep
from .decode._online import StepResult as StepResult
from .decode._online import pipelined_step as pipelined_step
from .decode._retrieve import EntryBuffer as EntryBuffer
from .decode._retrieve import Retrieval as Retrieval
from .decode._retrieve import RetrievalStats as RetrievalStats
from .decode._retrieve import Retriever as Retriever
from .decode._selectors import MedoidSelector as MedoidSelector
from .decode._selectors import Selector as Selector
from .store._engine import DiskStats as DiskStats
from .store._engine import Engine as Engine
from .store._engine import EngineStats as EngineStats
from .store._index import LayerIndex as LayerIndex
from .store._planner import Plan as Plan
from .store._planner import plan_reads as plan_reads
from .store._store import Store as Store
from .store._store import StoreStats as StoreStats

__all__ = ["DiskStats", "Engine", "EngineStats", "ChecksumError", "ConcurrentUseError",
           "ConfigError", "DiskError", "DiskFullError", "DiskMismatchError",
           "DiskMissingError", "DiskTruncatedError", "IOFailedError", "InternalError",
           "InvalidArgumentError", "InvalidBoolError", "InvalidCallError", "InvalidChoiceError",
           "InvalidDtypeError", "InvalidFractionError", "InvalidIndexError",
           "InvalidIntegerError", "InvalidNumberError", "InvalidPathError", "InvalidRatioError",
           "InvalidTypeError", "LayoutError", "ManifestError", "MisalignedRequestError",
           "ModelError", "MountError", "NotFoundError", "OutOfRangeError", "ShapeError",
           "StoreExistsError", "StoreNotFoundError", "SwarmError", "LayerIndex",
           "DecodeSession", "EntryBuffer", "PipelinedStep", "pipelined_step", "StepResult",
           "MedoidSelector", "Selector", "Plan",
           "plan_reads", "Store", "Retrieval", "RetrievalStats", "Retriever", "StoreStats"]

__version__ = "0.1.0"
