"""Drop-in Hugging Face caches and the ``"kvstack"`` attention implementation.

Importing this module registers ``attn_implementation="kvstack"`` with transformers.
"""

from kvstack.hf.attention import ATTENTION_NAME, kvstack_attention, register, set_backend
from kvstack.hf.paged import PagedCache, PagedLayer
from kvstack.hf.token_table_cache import TokenTableCache, TokenTableLayer

register()

__all__ = [
    "ATTENTION_NAME",
    "PagedCache",
    "PagedLayer",
    "TokenTableCache",
    "TokenTableLayer",
    "kvstack_attention",
    "register",
    "set_backend",
]
