"""KV pages across device, host and disk (PersistentKV / KVDrive, with AsymCache's eviction).

* ``DiskTier``: page files written with a checksum and an atomic rename (``disk``).
* ``TieredStore``: one home and any number of copies per page, copy-then-switch moves, budgets
  in bytes per tier, accounting of moves and hits (``store``).
* Eviction rules that rank a full tier's pages: ``LRU``, ``AttentionAware``, ``CostAware``
  (``eviction``).
* ``Prefetcher``: the next layer's pages fetched on worker threads while a layer computes.
* ``TieredCache``: a lossless Hugging Face cache over the tiers.
* ``TurnStore``: conversations' K/V between their turns on the engine, evicted without loss
  (``turns``).
* The ``"kvstack_tiers"`` attention (registered on import): sdpa's outputs, plus the attention
  scores that place pages at prefill and feed the attention-aware rule (``attention``).
"""

from kvstack.tiers.attention import ATTENTION_NAME, key_attention_mass, register
from kvstack.tiers.cache import TieredCache, TieredLayer
from kvstack.tiers.disk import DiskTier, decode_page, encode_page, page_file_bytes, page_nbytes
from kvstack.tiers.eviction import LRU, RULES, TIERS, AttentionAware, CostAware, PageInfo
from kvstack.tiers.prefetch import Prefetcher
from kvstack.tiers.store import TieredStore
from kvstack.tiers.turns import TailFirstLRU, TurnStats, TurnStore

register()

__all__ = [
    "ATTENTION_NAME",
    "LRU",
    "RULES",
    "TIERS",
    "AttentionAware",
    "CostAware",
    "DiskTier",
    "PageInfo",
    "TailFirstLRU",
    "Prefetcher",
    "TieredCache",
    "TieredLayer",
    "TieredStore",
    "TurnStats",
    "TurnStore",
    "decode_page",
    "encode_page",
    "key_attention_mass",
    "page_file_bytes",
    "page_nbytes",
]
