"""transformers integration: decode a causal LM with its KV cache on swarmfs.

``import swarmfs.hf`` registers an attention function ``"swarm"`` with
transformers' ``AttentionInterface`` (and the matching mask function), and
provides :class:`SwarmCache`, a ``transformers.Cache``.  With a Llama, Qwen2,
Qwen3 or Mistral model::

    import swarmfs.hf
    model = swarmfs.hf.enable(AutoModelForCausalLM.from_pretrained(d))
    # (attn_implementation="swarm" also switches the attention, but only
    # enable() hooks the embeddings so the prefill fingerprints its prompt)
    cache = swarmfs.hf.SwarmCache("doc-store", model.config, ratio=0.1, disks=4)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)
    cache.close()
    # a later request continuing the document, checked against the store:
    cache = swarmfs.hf.SwarmCache.from_store("doc-store", model.config, input_ids=request)

What happens (SWARM §5-§7):

* **Prefill** attends densely (transformers' SDPA path).  In each layer's
  attention call the prompt's own post-RoPE queries profile co-activation
  (:func:`swarmfs.layout.profile_layer`, causal, at the sparsity ratio r),
  Algorithm 1 clusters the entries with replication, eq. 6 chooses the hot
  clusters under the DRAM budget, and the layer's KV is written to the store
  (eq. 7 placement, striped, checksummed).  The layer's K and V are then
  dropped: after prefill no full prefix KV stays in RAM.
* **Decode**: each layer's query goes to a :class:`~swarmfs.DecodeSession`
  over one :class:`~swarmfs.Retriever`: medoid scoring, clusters until the
  entry budget ceil(r x S) (local window included), DRAM hits (window, hot
  clusters) and one batched io_uring read for the rest.  Attention runs over
  the retrieved entries plus the new tokens still in DRAM plus the current
  token.  New tokens join clusters by eq. 9 after W steps and are appended
  to the store (``append=True``); the hot set follows §6.2 replacement.
* **DRAM residency**: per layer the medoid index, the local window, the hot
  clusters and the pending new tokens.  Nothing else of the prefix.
* **Layer pipelining (§7)**: the query of layer L+1 does not exist before
  layer L's output, so an exact prefetch is impossible.  ``prefetch=
  "previous"`` starts layer L+1's retrieval (in the Retriever's background
  thread) when layer L attends, with layer L+1's query of the previous decode
  step; layer L+1 then attends over what that retrieval returned (plus the
  window and the pending tokens).  The exact query then scores the medoids
  (CPU only, no I/O) so that the prefetch hit rate -- the fraction of the
  entries the exact selection wants that the prefetched one holds -- is
  recorded (:meth:`SwarmCache.summary`).  At r = 1 both select everything.
  ``prefetch="none"`` (default) retrieves with the exact query on the
  critical path.
* **Reuse**: :meth:`SwarmCache.from_store` reopens a stored prefix; a later
  request that starts with the same tokens decodes from the disks without a
  new prefill.  With ``append=False`` (the default for ``from_store``) the
  request's new tokens stay in DRAM and the stored document is unchanged.

A model whose attention does not go through ``"swarm"`` would attend to the
new tokens only; the SwarmCache detects that at the next call of the layer
(before any decode output) and raises ConfigError.

Limits: batch size 1; no beam search (``reorder_cache``), no ``crop``;
sliding-window layers only while the context fits their window.

Concurrency: one SwarmCache serves one request at a time (one thread calls
the model).  Its Retriever's prefetch thread is the only other thread.
Several SwarmCaches may read one store at the same time when none appends
(``append=False``); a store being appended to has one writer (the Store's
lock refuses a second process).
"""

from ._cache import ATTENTION as ATTENTION
from ._cache import METHODS as METHODS
from ._cache import StepStats as StepStats
from ._cache import SwarmCache as SwarmCache
from ._cache import SwarmLayer as SwarmLayer
from ._cache import enable as enable
from ._cache import prefix_fingerprint as prefix_fingerprint
from ._cache import register as register
from ._cache import swarm_attention_forward as swarm_attention_forward

__all__ = ['ATTENTION', 'METHODS', 'SwarmCache', 'SwarmLayer', 'StepStats', 'enable', 'register',
           'prefix_fingerprint', 'swarm_attention_forward']
