"""The decode path: scoring the DRAM index, choosing clusters, the local window
and hot clusters, batched retrieval and online updates (SWARM §5.2, §6).

Depends on :mod:`swarmfs.store`; the public names are re-exported by
:mod:`swarmfs`.
"""

from ._online import DecodeSession as DecodeSession
from ._online import PipelinedStep as PipelinedStep
from ._online import StepResult as StepResult
from ._online import pipelined_step as pipelined_step
from ._retrieve import EntryBuffer as EntryBuffer
from ._retrieve import Retrieval as Retrieval
from ._retrieve import RetrievalStats as RetrievalStats
from ._retrieve import Retriever as Retriever
from ._selectors import MedoidSelector as MedoidSelector
from ._selectors import Selector as Selector

__all__ = ["DecodeSession", "EntryBuffer", "PipelinedStep", "StepResult", "pipelined_step",
           "Retrieval", "RetrievalStats", "Retriever", "MedoidSelector", "Selector"]
