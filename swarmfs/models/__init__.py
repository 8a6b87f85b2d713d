"""Models shipped with swarmfs and the corpus they were trained on.

* :data:`DEFAULT_DECODER` -- directory of ``swarm-llama``, the small Llama
  decoder trained here (``tools/train_decoder.py``, docs/model.md); load it
  with ``AutoModelForCausalLM.from_pretrained(DEFAULT_DECODER)`` and
  ``AutoTokenizer.from_pretrained(DEFAULT_DECODER)``.
* :func:`heldout_texts` / :func:`heldout_documents` -- the text it was never
  trained on, for held-out perplexity and long-context inputs.
"""

import pathlib

from ._corpus import KINDS as KINDS
from ._corpus import Document as Document
from ._corpus import data_dir as data_dir
from ._corpus import documents as documents
from ._corpus import heldout_documents as heldout_documents
from ._corpus import heldout_texts as heldout_texts
from ._corpus import stdlib_dir as stdlib_dir
from ._corpus import training_texts as training_texts

__all__ = ["KINDS", "Document", "data_dir", "documents", "heldout_documents", "heldout_texts",
           "stdlib_dir", "training_texts", "DEFAULT_DECODER", "DECODER_TRAINED_TOKENS"]

#: Directory of the trained decoder (config, safetensors, tokenizer).
DEFAULT_DECODER: pathlib.Path = pathlib.Path(__file__).resolve().parent / "swarm-llama"

#: Longest context the trained decoder saw in training (tokens; docs/model.md:
#: "trained to 16384").  Its config allows 32,768 positions, but past this
#: length its output is not trained; ``swarmfs generate`` warns before any work.
DECODER_TRAINED_TOKENS: int = 16384
