"""Offline layout (SWARM §5): capture, profile, co-activation clustering,
DRAM partition and placement.  Installed as ``swarmfs.layout``.

Heavy dependencies (torch, transformers) load only when capture runs.
"""

# eq. 6, the local window and eq. 7 are the runtime's rules, which the layout
# applies offline: their layout names
from ..decode._hot import cluster_scores as cluster_scores
from ..decode._hot import hot_clusters as hot_clusters
from ..decode._window import window_mask as local_window_mask
from ..decode._window import window_positions as local_window
from ..store._placement import Placement as Placement
from ..store._placement import copy_locations as copy_locations
from ..store._placement import place_clusters as place_clusters
from ..store._placement import start_disks as start_disks
from ._capture import Capture as Capture
from ._capture import capture as capture
from ._capture import default_model_path as default_model_path
from ._capture import load_capture as load_capture
from ._capture import read_text as read_text
from ._capture import save_capture as save_capture
from ._capture import stdlib_text as stdlib_text
from ._cluster import Clustering as Clustering
from ._cluster import ClusterStats as ClusterStats
from ._cluster import NeighbourGraph as NeighbourGraph
from ._cluster import build_clusters as build_clusters
from ._cluster import cluster as cluster
from ._cluster import coactivation_distance as coactivation_distance
from ._cluster import eq2_tau as eq2_tau
from ._cluster import graph_from_distances as graph_from_distances
from ._cluster import neighbour_graph as neighbour_graph
from ._layer import LayoutParams as LayoutParams
from ._layer import lay_out_layer as lay_out_layer
from ._profile import Profile as Profile
from ._profile import profile_capture as profile_capture
from ._profile import profile_layer as profile_layer
from ._profile import sample_queries as sample_queries
from ._quality import RecallReport as RecallReport
from ._quality import block_clustering as block_clustering
from ._quality import evaluate_recall as evaluate_recall

__all__ = ["Capture", "capture", "default_model_path", "load_capture", "read_text",
           "save_capture", "stdlib_text", "Clustering", "ClusterStats", "NeighbourGraph",
           "build_clusters", "cluster", "coactivation_distance", "eq2_tau",
           "graph_from_distances", "neighbour_graph", "LayoutParams", "lay_out_layer",
           "cluster_scores", "hot_clusters",
           "local_window", "local_window_mask", "Placement", "copy_locations",
           "place_clusters", "start_disks", "Profile", "profile_capture", "profile_layer",
           "sample_queries", "RecallReport", "block_clustering", "evaluate_recall"]
