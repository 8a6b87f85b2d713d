"""Offload-friendly partition between DRAM and the SSDs (SWARM §5.2).

DRAM holds three things: the medoids (the index, kept by the store), the
local window (the last ``W`` context entries) and the *hot clusters* chosen
by the eq. 6 cost-benefit score.  The rules live in the runtime, which applies
them online as well: eq. 6 in :mod:`swarmfs.decode._hot`, the local window in
:mod:`swarmfs.decode._window`, the defaults in :mod:`swarmfs._defaults`.  This module
gives them their ``swarmfs.layout`` names.
"""

from __future__ import annotations

from .._defaults import LOCAL_WINDOW as DEFAULT_LOCAL_WINDOW
from .._defaults import SSD_GBPS as DEFAULT_SSD_GBPS
from .._defaults import T_BASE_US as DEFAULT_T_BASE_US
from ..decode._hot import cluster_scores as cluster_scores
from ..decode._hot import hot_clusters as hot_clusters
from ..decode._window import window_mask as local_window_mask
from ..decode._window import window_positions as local_window

__all__ = ["DEFAULT_LOCAL_WINDOW", "DEFAULT_SSD_GBPS", "DEFAULT_T_BASE_US", "cluster_scores",
           "hot_clusters", "local_window", "local_window_mask"]
