"""Reusable fact KV (InferScale): facts encoded once with their conversation context, stored
with an embedding, retrieved by cosine and injected at a prompt's positions by chunked RoPE.

* ``FactMemory`` (``memory``): add, retrieve, inject, build a ready cache, save and reopen.
* ``MiniLMEmbedder``, ``cosine_top_k`` (``embedding``): the default sentence embedder and the
  vectorised retrieval.
* ``storage``: one safetensors file and a JSON index, written atomically and checksummed, one
  writer at a time; ``StoreChanged``: a save refused because another writer saved first.
"""

from kvstack.facts.embedding import MiniLMEmbedder, cosine_top_k
from kvstack.facts.memory import Fact, FactMemory, model_identity
from kvstack.facts.storage import StoreChanged

__all__ = ["Fact", "FactMemory", "MiniLMEmbedder", "StoreChanged", "cosine_top_k", "model_identity"]
