"""kvstack — KV-cache memory management for LLM inference.

Layers: ``kvstack.reference`` (the executable specification), ``kvstack.compiled``
(torch.compile twins), ``kvstack.cuda_kernels`` (CUDA C++ custom ops). Callers reach operations
through ``kvstack.ops``, which names each operation once with every implementation that can run
here. Importing ``kvstack`` is cheap: subpackages load on first use.
"""

from kvstack.errors import (
    BackendUnavailable,
    DeadTokenError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidDTypeError,
    KVStackError,
    PoolExhausted,
    SlotOutOfRangeError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "DeadTokenError",
    "DoubleFreeError",
    "InvalidArgumentError",
    "InvalidDTypeError",
    "KVStackError",
    "PoolExhausted",
    "SlotOutOfRangeError",
    "__version__",
]
