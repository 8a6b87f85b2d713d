"""Cluster placement over the disks: SWARM §5.2, eq. 7, for the offline layout.

The striping and placement contract lives in the runtime
(:mod:`swarmfs.store._placement`): the store, the index and the writer read and write
by it, and the layout builds on it.  This module re-exports it under its
``swarmfs.layout`` names.
"""

from ..store._placement import PLACEMENTS as PLACEMENTS
from ..store._placement import Placement as Placement
from ..store._placement import copy_locations as copy_locations
from ..store._placement import place_clusters as place_clusters
from ..store._placement import start_disks as start_disks
from ..store._placement import stripe_counts as stripe_counts

__all__ = ["Placement", "PLACEMENTS", "start_disks", "stripe_counts", "place_clusters",
           "copy_locations"]
