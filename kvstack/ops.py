"""The op registry: every operation named once, with its reference and its faster twins.

    from kvstack import ops
    attention = ops.get("paged_attention")               # fastest backend that loaded here
    attention = ops.get("paged_attention", "reference")  # the specification

Backends, in order of preference: ``cuda`` (kvstack.cuda_kernels, CUDA tensors), ``cpp``
(kvstack.cuda_kernels' C++ kernels for CPU tensors), ``compiled`` (kvstack.compiled,
torch.compile), ``reference`` (kvstack.reference, always there). The first two run on one kind
of device only: a caller whose tensors may live on either passes ``device`` to ``get``. A backend
that cannot load is recorded with its reason (``ops.report()``) and asking for it raises
``BackendUnavailable`` with that reason; nothing is replaced silently. ``spec_tests`` iterates
``OPERATIONS`` so that every fast implementation is checked against its reference.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstack.errors import BackendUnavailable, InvalidArgumentError

BACKENDS = ("cuda", "cpp", "compiled", "reference")
# The device types a backend's kernels take; a backend not named here takes any.
BACKEND_DEVICES = {"cuda": "cuda", "cpp": "cpu"}


@dataclass
class Operation:
    name: str
    reference: Callable
    implementations: dict[str, Callable] = field(default_factory=dict)  # backend -> callable
    unavailable: dict[str, str] = field(default_factory=dict)  # backend -> why it did not load

    def backends(self, device: torch.device | str | None = None) -> list[str]:
        """The available backends, fastest first; with ``device``, those that run on it."""
        kind = None if device is None else torch.device(device).type
        return [
            b
            for b in BACKENDS
            if b in self.implementations and (kind is None or BACKEND_DEVICES.get(b, kind) == kind)
        ]


# name -> (reference "module:function", compiled "module:function")
_SPEC = {
    "paged_attention": ("attention", "attention"),
    "decode_attention": ("attention", "attention"),
    "ragged_decode_attention": ("ragged", "ragged"),
    "merge_attention_states": ("merge", "merge"),
    "multi_segment_attention": ("merge", "merge"),
    "copy_slots": ("repack", "repack"),
    "move_pages": ("arena", "arena"),
    "rotate_keys": ("rope", "rope"),
    "rerotate_keys": ("rope", "rope"),
}

OPERATIONS: dict[str, Operation] = {}


def _load() -> None:
    if OPERATIONS:
        return
    for name, (ref_module, compiled_module) in _SPEC.items():
        reference = getattr(importlib.import_module(f"kvstack.reference.{ref_module}"), name)
        op = Operation(name, reference, {"reference": reference})
        try:
            op.implementations["compiled"] = getattr(
                importlib.import_module(f"kvstack.compiled.{compiled_module}"), name
            )
        except Exception as error:  # a broken torch.compile install must not hide the reference
            op.unavailable["compiled"] = f"compiled backend failed to import: {error!r}"
        OPERATIONS[name] = op
    try:
        from kvstack import cuda_kernels

        for name, fn in cuda_kernels.load().items():
            OPERATIONS[name].implementations["cuda"] = fn
    except BackendUnavailable as error:
        for op in OPERATIONS.values():
            op.unavailable["cuda"] = str(error)
    try:
        from kvstack import cuda_kernels

        for name, fn in cuda_kernels.load_cpu().items():
            OPERATIONS[name].implementations["cpp"] = fn
    except BackendUnavailable as error:
        for op in OPERATIONS.values():
            op.unavailable["cpp"] = str(error)
    for op in OPERATIONS.values():
        for backend in ("cuda", "cpp", "compiled"):
            if backend not in op.implementations and backend not in op.unavailable:
                op.unavailable[backend] = f"{backend} backend has no implementation of {op.name}"


def operations() -> dict[str, Operation]:
    _load()
    return OPERATIONS


def get(
    name: str, backend: str | None = None, *, device: torch.device | str | None = None
) -> Callable:
    """The implementation of ``name`` on ``backend`` (None: the first available of BACKENDS,
    or with ``device`` the first that runs on that device)."""
    _load()
    if name not in OPERATIONS:
        raise InvalidArgumentError(f"name must be one of {sorted(OPERATIONS)}, got {name!r}")
    op = OPERATIONS[name]
    if backend is None:
        return op.implementations[op.backends(device)[0]]
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend not in op.implementations:
        raise BackendUnavailable(op.unavailable[backend])
    return op.implementations[backend]


def report() -> str:
    """One line per operation and backend: available, or why not."""
    _load()
    lines = []
    for op in OPERATIONS.values():
        for backend in BACKENDS:
            status = "available" if backend in op.implementations else op.unavailable[backend]
            lines.append(f"{op.name:<26} {backend:<9} {status}")
    return "\n".join(lines)
