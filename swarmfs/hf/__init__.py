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
    # a batch: one store per row, rows padded on the left (padding_side="left")
    enc = tok(prompts, return_tensors="pt", padding=True)
    cache = swarmfs.hf.SwarmCache(["a", "b", "c"], model.config, ratio=0.1)
    out = model.generate(**enc, cache=cache, max_new_tokens=64)

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
  the retrieved entries plus the attention sinks (the first
  ``sinks`` tokens, default 4, kept in DRAM) plus the new tokens still in
  DRAM plus the current token.  New tokens stay in DRAM for W steps (the
  layout's local window, 256), then join clusters by eq. 9 and are appended
  to the store (``append=True``); the hot set follows §6.2 replacement.  S
  is the stored length as it grows: the budget ceil(rS) and the query's
  window min(W, S, ceil(rS) // 4) follow it.
* **Batches**: each row of the input is its own request with its own store
  (``SwarmCache([path, ...])``) or stored document
  (``SwarmCache.from_store([path, ...])``; rows may share one, read-only).
  Rows are padded on the left; padding is cut off before the layout, so it
  is never profiled, clustered, stored or counted in a budget, and a row
  decodes exactly as it would alone.  Per layer and token one retrieval
  serves all rows of a shared document (their clusters united in one read;
  each row attends to its own selection), and the other documents' reads
  run meanwhile on their Retrievers' threads.  A row fed its end-of-text
  (``eos_token_id``) has finished: generate's padding after it is neither
  attended, kept nor written.
* **K and V dtypes**: one store dtype.  Under ``torch.autocast`` (K float32
  after RoPE, V in the autocast dtype) both are cast to the autocast dtype,
  which SDPA computes in anyway; without autocast a mismatch is a
  ShapeError before anything is written.
* **generate()** (through :func:`enable`'s wrapper): beam and contrastive
  search are refused before any token is fed (beams would each need their
  own new tokens reordered at every step, and only the end tells which to
  store); assisted and prompt-lookup decoding lay out the prompt only, keep
  draft tokens in DRAM until accepted, and :meth:`SwarmCache.crop` drops the
  rejected ones, so nothing unaccepted is ever written.
* **DRAM residency**: per layer the medoid index, the local window, the hot
  clusters, the attention sinks and the pending new tokens.  Nothing else
  of the prefix.
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

Limits: no beam or contrastive search; ``crop`` removes new tokens still
in DRAM only; assisted decoding serves one row and starts from a new store;
rows are fixed when the cache is made (one store per row); ``prefetch=
"previous"`` serves one row; sliding-window layers only while the context
fits their window.  The rows' reads run concurrently, not in one io_uring
submission across stores.

Concurrency: one SwarmCache serves one request at a time (one thread calls
the model).  Its Retriever's prefetch thread is the only other thread.
Several SwarmCaches may read one store at the same time when none appends
(``append=False``); a store being appended to has one writer (the Store's
lock refuses a second process).
"""

from ._attention import ATTENTION as ATTENTION
from ._attention import enable as enable
from ._attention import prefix_fingerprint as prefix_fingerprint
from ._attention import register as register
from ._attention import swarm_attention_forward as swarm_attention_forward
from ._cache import METHODS as METHODS
from ._cache import StepStats as StepStats
from ._cache import SwarmCache as SwarmCache
from ._cache import SwarmLayer as SwarmLayer

__all__ = ['ATTENTION', 'METHODS', 'SwarmCache', 'SwarmLayer', 'StepStats', 'enable', 'register',
           'prefix_fingerprint', 'swarm_attention_forward']

register()
