"""Drop-in Hugging Face caches and the ``"kvstack"`` attention implementation.

Importing this module registers ``attn_implementation="kvstack"`` with transformers.
"""

from kvstack.hf.attention import ATTENTION_NAME, kvstack_attention, register, set_backend
from kvstack.hf.paged import PagedCache, PagedLayer

register()

__all__ = [
    "ATTENTION_NAME",
    "PagedCache",
    "PagedLayer",
    "kvstack_attention",
    "register",
    "set_backend",
]
