"""Default parameters, one place each (the paper's values where it gives one).

Every module that takes one of these as a default imports it from here; the
README's "Python API" and the CLI's ``--help`` show the same values.
"""

from __future__ import annotations

__all__ = ["RATIO", "LOCAL_WINDOW", "T_BASE_US", "T_TRANSFER_US", "SSD_GBPS", "HOT_FRACTION",
           "ONLINE_TAU", "MAX_JOINS", "NEW_CLUSTER_SIZE", "FLUSH_BATCH", "DECODER_TAU",
           "DECODER_MAX_CLUSTER_SIZE", "DECODER_REPRESENTATIVE", "ATTENTION_SINKS"]

#: Sparsity ratio r: the fraction of a context's entries a query may use
#: (the entry budget is ceil(r x S)); SWARM §8.1 evaluates at 0.10.
RATIO = 0.10
#: Local window W in tokens, the last W entries kept in DRAM (§5.2: "e.g. 256 tokens").
LOCAL_WINDOW = 256
#: Eq. 6 T_base: SSD access latency (µs; a 4 KiB random read on a datacenter
#: NVMe SSD takes ~70-100 µs).
T_BASE_US = 80.0
#: Eq. 6 T_transfer: transfer cost of one entry (µs) in the demo's layout and
#: the online cache replacement.
T_TRANSFER_US = 2.0
#: Sequential SSD bandwidth (GB/s) from which ``layout.hot_clusters`` derives
#: T_transfer when it is not given.
SSD_GBPS = 3.0
#: DRAM budget for hot clusters, as a fraction of a layer's KV bytes (eq. 6
#: chooses which clusters fill it).
HOT_FRACTION = 0.02
#: Algorithm 1's clustering radius tau for a decoder's prompt laid out by
#: ``swarmfs.hf.SwarmCache`` (and so ``swarmfs demo`` and ``generate``) when
#: its ``layout`` gives none.  Lower than the offline layout's default (0.6,
#: tuned on MiniLM): the shipped decoder copies, its heads attend to single
#: far-back tokens that are rarely co-activated, and at 0.6 the merged
#: clusters cost recall (8K held-out tokens, r = 0.1: recall 0.90 / 0.89 at
#: 0.6 against 0.98 / 0.97 at 0.3 on Python / prose; docs/benchmarks.md §10).
#: 0.2 rather than 0.3 on the stage-4 decoder (``tools.suite``, r = 0.1):
#: at 0.3 a 2-entry cluster's medoid hid a needle its neighbour was, and
#: 16K Python perplexity was +8.3% (KL 0.068); at 0.2 KL is at the oracle
#: top-k's level at 8K and 16K on both texts (0.0024-0.0056), for 3% more
#: DRAM (0.524 of the KV against 0.509; docs/bench/long-context.md).
DECODER_TAU = 0.2
#: Cap on entries per cluster for a decoder's prompt (``SwarmCache`` when its
#: ``layout`` gives none); with DECODER_TAU it sets the operating point
#: (issue 23: entries per cluster, DRAM index size, read size).
DECODER_MAX_CLUSTER_SIZE = 64
#: What the DRAM index keeps per cluster for a decoder's prompt
#: (``SwarmCache`` when its ``layout`` gives none): ``"medoid"`` (SWARM §5.2)
#: or ``"centroid"`` (the members' mean key; ``Store.write_layer``).
DECODER_REPRESENTATIVE = "medoid"
#: Eq. 9 radius of the online maintenance (§6.2): a new entry joins clusters
#: co-activated in more than (1 - tau) of the W steps it is observed.
ONLINE_TAU = 0.5
#: Most clusters a new entry joins online (controlled replication, §6.2).
MAX_JOINS = 2
#: Entries per new cluster made of new entries that join none (§6.2).
NEW_CLUSTER_SIZE = 16
#: Matured new entries written together by one ``Store.append``.
FLUSH_BATCH = 32

#: Attention sinks of ``swarmfs.hf.SwarmCache``: the first tokens of a
#: document kept in DRAM and attended at every decode step beside the entry
#: budget (StreamingLLM's 4).  Measured on the shipped decoder (docs/hf.md).
ATTENTION_SINKS = 4
