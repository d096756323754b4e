"""Drop-in Hugging Face caches and the ``"kvstack"`` attention implementation.

Importing this module registers ``attn_implementation="kvstack"`` with transformers.
"""

from kvstack.hf.attention import ATTENTION_NAME, kvstack_attention, register, set_backend
from kvstack.hf.headwise import HeadwiseCache, HeadwiseLayer
from kvstack.hf.paged import PagedCache, PagedLayer
from kvstack.hf.token_table_cache import TokenTableCache, TokenTableLayer

register()

__all__ = [
    "ATTENTION_NAME",
    "HeadwiseCache",
    "HeadwiseLayer",
    "PagedCache",
    "PagedLayer",
    "TokenTableCache",
    "TokenTableLayer",
    "kvstack_attention",
    "register",
    "set_backend",
]
