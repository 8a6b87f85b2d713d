"""The store: on-disk format, manifest, disks, writes, the read planner, the
executor and the io_uring engine (SWARM §5.2 placement, §6.1 reads).

Depends only on :mod:`swarmfs._errors` and :mod:`swarmfs._defaults`; the
public names are re-exported by :mod:`swarmfs`.
"""

from ._engine import DiskStats as DiskStats
from ._engine import Engine as Engine
from ._engine import EngineStats as EngineStats
from ._index import LayerIndex as LayerIndex
from ._planner import Plan as Plan
from ._planner import plan_reads as plan_reads
from ._store import Store as Store
from ._store import StoreStats as StoreStats

__all__ = ["DiskStats", "Engine", "EngineStats", "LayerIndex", "Plan", "plan_reads", "Store",
           "StoreStats"]
