"""Serving many requests from one KV arena: ``Engine``, ``CacheSpec``, ``Sampling``.

Importing this module registers the engine's attention (``"kvstack_serve"``) with transformers.
"""

from kvstack.serve.cache_spec import CacheSpec
from kvstack.serve.engine import SERVE_ATTENTION, Engine, register
from kvstack.serve.request import Request, RequestStats, Sampling
from kvstack.serve.scheduler import (
    BatchRule,
    FIFORule,
    Outlook,
    PageAwareRule,
    RoundRobinRule,
    Work,
)
from kvstack.serve.swap import HostSwap, SwapStats

register()

__all__ = [
    "SERVE_ATTENTION",
    "BatchRule",
    "CacheSpec",
    "Engine",
    "FIFORule",
    "HostSwap",
    "Outlook",
    "PageAwareRule",
    "Request",
    "RequestStats",
    "RoundRobinRule",
    "Sampling",
    "SwapStats",
    "Work",
]
