"""The ``"swarm"`` attention function and the model hooks of :mod:`swarmfs.hf`
(its docstring tells the whole story; SWARM §5-§7).

* :func:`swarm_attention_forward` routes each attention call of a layer whose
  keys come from a :class:`~swarmfs.hf.SwarmCache` (prefill: dense SDPA, then
  the layout and the write; decode: attention over what the Retriever
  returned).
* :func:`enable` switches a model to it and adds two hooks: the input ids of
  each forward (kept per thread) and a guard on ``generate``, which refuses
  what a SwarmCache cannot serve (beam search) and prepares assisted
  decoding, before any token is fed.
* :func:`prefix_fingerprint` -- what a prefill records of its prompt.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from .. import _errors as errors
from .. import _validate as V

__all__ = ["ATTENTION", "register", "enable", "prefix_fingerprint", "swarm_attention_forward"]

#: name of the attention implementation registered with transformers
ATTENTION = "swarm"


def _sdpa(module, query, key, value, mask, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, mask, **kw)


@V.checked
def swarm_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout: float = 0.0, **kwargs):
    """The ``"swarm"`` attention function (transformers' AttentionInterface).

    Keys that come from a :class:`~swarmfs.hf.SwarmCache` carry a tag that
    routes the call: prefill attends densely with SDPA (padding masked as
    usual) and then lays each row's real tokens out and writes them to its
    store; a decode step attends, row by row, over what the row's Retriever
    returned.  Any other cache (or none) gets plain SDPA, so a model set to
    ``"swarm"`` still works with ``DynamicCache``.

    Args:
        module: the attention module (``layer_idx``, ``num_key_value_groups``).
        query: [B, H_q, T, d]; key, value: [B, H_kv, T', d].
        attention_mask: 4D mask [B, 1, T, T'] (bool or additive) or None.
        scaling: softmax scale.

    Returns:
        (attn_output [B, T, H_q, d], None).
    """
    tag = getattr(key, "_swarm", None)
    if tag is None:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout,
                     scaling=scaling, **kwargs)
    cache, layer, mode = tag
    cache.layers[layer].in_flight = False
    if mode == "prefill":
        out = _sdpa(module, query, key, value, attention_mask, dropout=dropout,
                    scaling=scaling, **kwargs)
        cache._lay_out(layer, query, key, value, scaling, attention_mask)
        return out
    return cache._decode(layer, module, query, key, value, scaling, attention_mask)


_REGISTERED = False


@V.checked
def register() -> None:
    """Register ``"swarm"`` with transformers' AttentionInterface and
    AttentionMaskInterface (the mask is SDPA's).  Idempotent; runs on import."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(ATTENTION, swarm_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    _REGISTERED = True


#: the input ids of the forward pass running on this thread (set by the hook
#: :func:`enable` puts on the model's input embeddings): a prefill records
#: their fingerprint in the store, so that ``SwarmCache.from_store`` can check
#: a later request's ids against it, and a decode step sees which rows were
#: fed their end-of-text token
_FORWARD = threading.local()


def _record_ids(module, args):
    ids = args[0] if args else None
    _FORWARD.ids = ids if getattr(ids, "ndim", 0) == 2 else None


def _forget_ids(module, args, output):
    _FORWARD.ids = None            # a later forward of an unhooked model sees none


def forward_ids():
    """The input ids [B, T] of the forward running on this thread (None
    without :func:`enable`'s hook)."""
    return getattr(_FORWARD, "ids", None)


@V.checked
def prefix_fingerprint(ids) -> dict:
    """{"tokens": n, "xxh3": hex digest of the ids as int64}: what a prefill
    records of its prompt (layer 0's ``extra["prefix"]``; a padded row's real
    tokens only)."""
    import xxhash
    a = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
    return {"tokens": int(a.shape[0]), "xxh3": xxhash.xxh3_64_hexdigest(a.tobytes())}


def _guard_generate(model) -> None:
    """Wrap ``model.generate`` (once): a SwarmCache given as ``cache=`` or
    ``past_key_values=`` sees the generation's settings before any token is
    fed (``SwarmCache._begin_generate``: beam search refused, assisted
    decoding prepared)."""
    if "generate" in vars(model) or not hasattr(model, "generate"):
        return
    orig = model.generate

    @functools.wraps(orig)
    def generate(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        begin = getattr(cache, "_begin_generate", None)
        if callable(begin):
            begin(model, args, kwargs)
        return orig(*args, **kwargs)
    model.generate = generate


@V.checked
def enable(model):
    """Switch a loaded model to the ``"swarm"`` attention implementation.

    Also hooks the model's input embeddings so that a prefill records a
    fingerprint of its prompt's token ids in the store (checked by
    ``SwarmCache.from_store`` when given the request's ids) and a decode
    step knows which rows of a batch were fed their end-of-text token, and
    wraps ``model.generate`` so that a SwarmCache sees the generation's
    settings before any token is fed: beam search is refused (ConfigError)
    and assisted or prompt-lookup decoding gets the prompt prefilled first,
    so that draft tokens are never laid out and can be cropped.

    Concurrency: the ids a forward pass sees are kept per thread (and
    forgotten when the model's forward returns), so forwards of one enabled
    model may run on several threads at once, each with its own
    ``SwarmCache``: each prefill records its own prompt.  One cache is used
    by one thread at a time.

    Returns:
        the model.

    Raises:
        ConfigError: the model does not accept the implementation.
    """
    register()
    try:
        model.set_attn_implementation(ATTENTION)
    except (ValueError, KeyError, AttributeError) as exc:
        raise errors.ConfigError(f"cannot switch the model to the swarm attention: {exc}") from None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and not getattr(emb, "_swarm_ids_hook", False):
        emb.register_forward_pre_hook(_record_ids)
        model.register_forward_hook(_forget_ids)
        emb._swarm_ids_hook = True
    _guard_generate(model)
    return model
