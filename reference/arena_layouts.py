"""Three memory layouts for hybrid (attention + recurrent-state) models, on a ``KVArena``.

A hybrid model's cache has two kinds of page: attention KV blocks, which grow with the sequence,
and one recurrent state per state layer and sequence (a Mamba/GDN layer's conv window and SSM
state), whose size is fixed. Serving systems lay the two out differently:

  ``padded_unified``  vLLM (v1 hybrid allocator): one pool of pages of one size P. The attention
      block is enlarged until one layer's block reaches a state page, and the state page is padded
      up to the block (``vllm_attention_block_size``). Small prompts leave most of a huge block
      empty.
  ``fixed_dual``      SGLang: two pools carved from the memory at start-up by a fixed ratio,
      ``--mamba-full-memory-ratio`` (default 0.9) = state pool bytes / KV pool bytes
      (``sglang_pool_split``). Token-granular KV slots, exact state slots; whichever pool the
      workload needs less of stays partly empty and the other cannot use it.
  ``kvstack``         ours: one arena, KV blocks of 16 tokens and exact-size state pages, both
      from the same free space, so capacity moves between kinds on demand.

Each layout admits a request all or nothing (state pages for every state layer, KV for the
prompt), then ``step()`` decodes one token for every running sequence (a new KV block whenever
a token starts one), frees finished sequences, and, when a block cannot be had, preempts the
youngest running sequence (vLLM's recompute preemption; it is readmitted later with the tokens
it had generated, like vLLM's re-prefill). ``run_trace`` drives a layout through a request trace
and records the peak; ``bench/arena_hybrid.py`` turns that into figures.

Every page lives on a ``KVArena`` built on ``device="meta"``: no memory is allocated, the
arena's bookkeeping (placement, alignment, compaction, exhaustion) is the real one.

Sizes come from real model configs through ``HybridGeometry``, whose state shapes use the
formulas of the transformers modeling code (``transformers_state_shapes``; checked against the
tensors a tiny model's ``DynamicCache`` holds in ``spec_tests/test_arena_layouts.py``).

Invariants (checked in ``spec_tests/test_arena_layouts.py``):
  L1 ``admit`` is all or nothing: a refused request changes no arena page or counter;
  L2 a layout holds, for every running sequence, exactly state_layers state pages and
     ceil(tokens / block_size) blocks per attention layer (token slots for ``fixed_dual``);
  L3 ``kvstack`` and ``fixed_dual`` never pad a state page; ``padded_unified`` pads a state page
     by exactly P - state bytes;
  L4 a finished trace leaves every arena with no request pages (``close`` then empties it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch

from kvstack.errors import ArenaExhausted, InvalidArgumentError
from kvstack.reference.arena import KVArena, Page, parse_bytes
from kvstack.reference.checks import check_positive_int

LAYOUTS = ("padded_unified", "fixed_dual", "kvstack")
KVSTACK_BLOCK_SIZE = 16  # tokens per KV block in our layout
# vLLM rounds its enlarged attention block to a multiple of the attention kernels' block
# alignment: 16 for FlashAttention/FlashInfer on Hopper (32 for head_dim 256 on Blackwell,
# 64/128 for MLA), vllm/model_executor/models/config.py, HybridAttentionMambaModelConfig.
VLLM_KERNEL_BLOCK_ALIGNMENT = 16
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's --mamba-full-memory-ratio default
SGLANG_PAGE_SIZE = 1  # SGLang's --page-size default: token-granular KV slots
_ARENA_DTYPE = torch.bfloat16  # arena element: 2 bytes; every page size here is even


# --------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class HybridGeometry:
    """The per-layer cache sizes of one hybrid model.

    Attention: ``attention_layers`` layers of ``num_kv_heads`` x ``head_dim`` keys and values,
    ``kv_dtype_bytes`` each. State: ``state_layers`` layers, each holding per sequence a conv
    state of ``conv_channels`` x ``conv_window`` elements (``conv_dtype_bytes``) and a recurrent
    state of shape ``recurrent_shape`` (``recurrent_dtype_bytes``).

    ``conv_window`` is how many conv inputs are kept: transformers keeps ``conv_kernel``
    (``DynamicCache``'s ``update_conv_state`` keeps the last ``conv_kernel_size`` columns);
    vLLM and SGLang keep ``conv_kernel - 1`` (the newest input is consumed at once):
    ``serving()`` is that geometry."""

    name: str
    attention_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    state_layers: int
    conv_channels: int
    conv_kernel: int
    conv_window: int
    recurrent_shape: tuple[int, ...]
    conv_dtype_bytes: int
    recurrent_dtype_bytes: int
    source: str = ""

    def __post_init__(self) -> None:
        for name in (
            "attention_layers",
            "num_kv_heads",
            "head_dim",
            "kv_dtype_bytes",
            "state_layers",
            "conv_channels",
            "conv_kernel",
            "conv_window",
            "conv_dtype_bytes",
            "recurrent_dtype_bytes",
        ):
            check_positive_int(name, getattr(self, name))
        if not self.recurrent_shape or any(
            isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in self.recurrent_shape
        ):
            raise InvalidArgumentError(
                f"recurrent_shape must be a non-empty tuple of positive ints, got "
                f"{self.recurrent_shape!r}"
            )

    @property
    def kv_token_bytes(self) -> int:
        """K and V of one token in one attention layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def conv_state_elements(self) -> int:
        return self.conv_channels * self.conv_window

    @property
    def recurrent_state_elements(self) -> int:
        return math.prod(self.recurrent_shape)

    @property
    def state_page_bytes(self) -> int:
        """One state layer's conv + recurrent state for one sequence, exactly."""
        return (
            self.conv_state_elements * self.conv_dtype_bytes
            + self.recurrent_state_elements * self.recurrent_dtype_bytes
        )

    @property
    def state_bytes_per_sequence(self) -> int:
        """Every state layer's state for one sequence (SGLang's ``mamba_cache_per_req``)."""
        return self.state_layers * self.state_page_bytes

    def transformers_state_shapes(self) -> tuple[tuple[int, int], tuple[int, ...]]:
        """Per-sequence (conv, recurrent) shapes as transformers' ``DynamicCache`` holds them
        (without the batch axis)."""
        return (self.conv_channels, self.conv_kernel), self.recurrent_shape

    def serving(self) -> HybridGeometry:
        """The geometry vLLM and SGLang store: conv window ``conv_kernel - 1``
        (vLLM ``MambaStateShapeCalculator``, SGLang ``Mamba2StateShape.create``)."""
        return replace(self, conv_window=self.conv_kernel - 1)


def geometry_from_config(
    config: Any,
    *,
    name: str,
    kv_dtype_bytes: int = 2,
    conv_dtype_bytes: int = 2,
    recurrent_dtype_bytes: int = 2,
    source: str = "",
) -> HybridGeometry:
    """A ``HybridGeometry`` from a transformers config of Jamba, NemotronH, Qwen3-Next or
    Qwen3.5 (text), with the state shapes the transformers modeling code builds:

      Jamba (modeling_jamba.py, JambaMambaMixer): intermediate = mamba_expand * hidden_size;
          conv [intermediate, mamba_d_conv], recurrent [intermediate, mamba_d_state];
      NemotronH (modeling_nemotron_h.py, NemotronHMamba2Mixer): intermediate =
          mamba_num_heads * mamba_head_dim, conv_dim = intermediate + 2 n_groups ssm_state_size;
          conv [conv_dim, conv_kernel], recurrent [mamba_num_heads, mamba_head_dim, ssm_state_size];
      Qwen3-Next / Qwen3.5 (modeling_qwen3_next.py, Qwen3NextGatedDeltaNet): key_dim =
          linear_key_head_dim * linear_num_key_heads, value_dim likewise; conv_dim = 2 key_dim +
          value_dim; conv [conv_dim, linear_conv_kernel_dim], recurrent
          [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim].

    Attention layers are the ``full_attention`` entries of ``config.layer_types``; head_dim is
    ``config.head_dim`` where the model has one, else hidden_size / num_attention_heads (Jamba)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ("jamba", "nemotron_h", "qwen3_next", "qwen3_5_text"):
        raise InvalidArgumentError(
            f"config must be a Jamba, NemotronH, Qwen3-Next or Qwen3.5 text config, got "
            f"model_type={model_type!r}"
        )
    layer_types = list(config.layer_types)
    attention_layers = layer_types.count("full_attention")
    state_layers = layer_types.count("linear_attention")
    if model_type == "jamba":
        head_dim = config.hidden_size // config.num_attention_heads
        intermediate = config.mamba_expand * config.hidden_size
        conv_channels, conv_kernel = intermediate, config.mamba_d_conv
        recurrent = (intermediate, config.mamba_d_state)
    elif model_type == "nemotron_h":
        head_dim = config.head_dim
        intermediate = config.mamba_num_heads * config.mamba_head_dim
        conv_channels = intermediate + 2 * config.n_groups * config.ssm_state_size
        conv_kernel = config.conv_kernel
        recurrent = (config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size)
    else:  # Qwen3-Next, Qwen3.5
        head_dim = config.head_dim
        key_dim = config.linear_key_head_dim * config.linear_num_key_heads
        value_dim = config.linear_value_head_dim * config.linear_num_value_heads
        conv_channels, conv_kernel = 2 * key_dim + value_dim, config.linear_conv_kernel_dim
        recurrent = (
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
    return HybridGeometry(
        name=name,
        attention_layers=attention_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        kv_dtype_bytes=kv_dtype_bytes,
        state_layers=state_layers,
        conv_channels=conv_channels,
        conv_kernel=conv_kernel,
        conv_window=conv_kernel,
        recurrent_shape=recurrent,
        conv_dtype_bytes=conv_dtype_bytes,
        recurrent_dtype_bytes=recurrent_dtype_bytes,
        source=source,
    )


# The geometry fields of each checkpoint's config.json. No hub access here: the values are the
# ones published config.json files hold as transcribed in public repositories (cited per model),
# cross-checked against the transformers config class defaults where those name the checkpoint.
# KV and conv states are bf16 (the checkpoints' torch_dtype). The recurrent (SSM) state dtype is
# what vLLM resolves per model, since the padded layout (and its 528-token figure) depends on it.
JAMBA_1_5_MINI = {
    # ai21labs/AI21-Jamba-1.5-Mini/config.json, as transcribed in sdpython/onnx-diagnostic
    # (get_ai21_jamba_15_mini). Every field here equals JambaConfig's default (the class
    # docstring names ai21labs/Jamba-v0.1, whose geometry 1.5-Mini keeps): 32 layers, attention
    # at i % 8 == 4 -> 4 attention + 28 Mamba layers.
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}
NEMOTRON_H_8B = {
    # nvidia/Nemotron-H-8B-Base-8K/config.json, as transcribed in public test fixtures; matches
    # NVIDIA Megatron-Bridge's docs (8B: 52 layers, hidden 4096, the pattern below). NOT the
    # NemotronHConfig defaults: the class docstring names nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B
    # but its default layers_block_type is a 4-layer toy, so every field is set here.
    # Pattern: M = Mamba2, * = attention, - = MLP -> 24 Mamba2 + 4 attention layers.
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
}
QWEN3_NEXT_80B_A3B = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct/config.json (48 L, 16 H, 2 KV, head 256, linear 32 V /
    # 16 K heads x 128, full_attention_interval 4), as cited in public repositories. Every field
    # equals Qwen3NextConfig's default (its docstring names this checkpoint) -> 12 attention +
    # 36 Gated DeltaNet layers.
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
QWEN3_5_9B = {
    # Qwen/Qwen3.5-9B text_config, as transcribed in public test fixtures (32 L, 4 KV heads,
    # head 256, layer_types 3 x linear + 1 x full, GDN 16 K / 32 V heads x 128, kernel 4,
    # "mamba_ssm_dtype": "float32"). Equal to Qwen3_5TextConfig's defaults. Used only to check
    # the padded rule against vLLM's reported 528-token block.
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}


def jamba_1_5_mini() -> HybridGeometry:
    from transformers import JambaConfig

    return geometry_from_config(
        JambaConfig(**JAMBA_1_5_MINI),
        name="jamba-1.5-mini",
        # vLLM's mamba_ssm_cache_dtype "auto" -> the model dtype for Jamba (no per-model hook).
        recurrent_dtype_bytes=2,
        source="ai21labs/AI21-Jamba-1.5-Mini config.json (JambaConfig defaults)",
    )


def nemotron_h_8b() -> HybridGeometry:
    from transformers import NemotronHConfig

    return geometry_from_config(
        NemotronHConfig(**NEMOTRON_H_8B),
        name="nemotron-h-8b",
        # fp32 SSM state: NemotronHConfig's mamba_ssm_cache_dtype default, and vLLM's
        # NemotronHForCausalLMConfig hook (DEFAULT_MAMBA_SSM_CACHE_DTYPE = "float32").
        recurrent_dtype_bytes=4,
        source="nvidia/Nemotron-H-8B-Base-8K config.json (set explicitly: not the defaults)",
    )


def qwen3_next_80b_a3b() -> HybridGeometry:
    from transformers import Qwen3NextConfig

    return geometry_from_config(
        Qwen3NextConfig(**QWEN3_NEXT_80B_A3B),
        name="qwen3-next-80b-a3b",
        # vLLM "auto" -> bf16; assumes config.json sets no mamba_ssm_dtype (not verified here).
        recurrent_dtype_bytes=2,
        source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json (Qwen3NextConfig defaults)",
    )


def qwen3_5_9b() -> HybridGeometry:
    from transformers import Qwen3_5TextConfig

    return geometry_from_config(
        Qwen3_5TextConfig(**QWEN3_5_9B),
        name="qwen3.5-9b",
        # vLLM's Qwen3_5ForConditionalGenerationConfig hook copies config.json's
        # mamba_ssm_dtype ("float32") into mamba_ssm_cache_dtype.
        recurrent_dtype_bytes=4,
        source="Qwen/Qwen3.5-9B config.json text_config (Qwen3_5TextConfig defaults)",
    )


# --------------------------------------------------------------------------- the two rules
def vllm_attention_block_size(
    geometry: HybridGeometry, alignment: int = VLLM_KERNEL_BLOCK_ALIGNMENT
) -> int:
    """vLLM's attention block size for a hybrid model, in tokens: the smallest multiple of the
    kernel block alignment whose one-layer block holds at least one state page,
    ``alignment * cdiv(state_page, alignment * kv_token_bytes)``
    (vllm/model_executor/models/config.py, ``HybridAttentionMambaModelConfig.
    verify_and_update_config``, the branch without prefix caching). For Qwen3.5-9B this gives
    16 * cdiv(2,146,304, 16 * 4,096) = 528, the block size vLLM reports."""
    check_positive_int("alignment", alignment)
    return alignment * math.ceil(geometry.state_page_bytes / (alignment * geometry.kv_token_bytes))


def vllm_page_bytes(geometry: HybridGeometry, alignment: int = VLLM_KERNEL_BLOCK_ALIGNMENT) -> int:
    """P: one page of vLLM's unified pool, an attention block of one layer; the state page is
    padded up to it (``mamba_page_size_padded``)."""
    return vllm_attention_block_size(geometry, alignment) * geometry.kv_token_bytes


@dataclass(frozen=True)
class DualSplit:
    """SGLang's two pools: ``state_slots`` request states and ``kv_tokens`` token slots."""

    state_slots: int
    state_pool_bytes: int
    kv_tokens: int
    kv_pool_bytes: int


def sglang_pool_split(
    capacity_bytes: int,
    geometry: HybridGeometry,
    ratio: float = SGLANG_MAMBA_FULL_MEMORY_RATIO,
    page_size: int = SGLANG_PAGE_SIZE,
) -> DualSplit:
    """SGLang's split of the KV-cache memory (python/sglang/srt/model_executor/
    model_runner_kv_cache_mixin.py, ``ModelRunnerKVCacheMixin.handle_max_mamba_cache``): solve
    ``state + kv == rest`` and ``state / kv == mamba_full_memory_ratio``, so the state pool gets
    rest * r / (1 + r), rounded down to whole request states (``max_mamba_cache_size``), and
    every byte left goes to the KV pool (``profile_max_num_token``: rest // cell_size tokens,
    cell = one token in every attention layer), in whole pages of ``page_size`` tokens."""
    if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 0):
        raise InvalidArgumentError(f"ratio must be a positive number, got {ratio!r}")
    check_positive_int("page_size", page_size)
    per_request = geometry.state_bytes_per_sequence
    state_slots = int(capacity_bytes * ratio / (1 + ratio)) // per_request
    state_pool = state_slots * per_request
    cell = geometry.kv_token_bytes * geometry.attention_layers
    kv_tokens = (capacity_bytes - state_pool) // cell // page_size * page_size
    return DualSplit(state_slots, state_pool, kv_tokens, kv_tokens * cell)


# --------------------------------------------------------------------------- layouts
class LengthRequest(Protocol):
    """What a layout reads from a request (``kvstack.workloads.TraceRequest`` is one)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def output_tokens(self) -> int: ...


@dataclass(eq=False)
class _Sequence:
    """One admitted request: it holds ``tokens`` = prompt + decoded so far (``tokens_at``)."""

    request: Any
    order: int  # admission counter: older sequences grow first, the youngest is preempted
    prompt: int  # tokens at admission (the prompt, plus what it had generated if readmitted)
    remaining: int  # tokens still to decode
    admitted_step: int
    generated_before: int  # output tokens generated before an earlier preemption
    units: int = 0  # KV blocks (token pages for fixed_dual) held per attention layer
    kv_pages: list[Page] = field(default_factory=list)
    state_pages: list[Page] = field(default_factory=list)

    def tokens_at(self, step: int) -> int:
        """Tokens held after ``step`` steps (admitted after step ``admitted_step``)."""
        return self.prompt + (step - self.admitted_step)

    def pages_moved(self, moves: dict[Page, int]) -> None:
        pass  # nothing here is addressed by offset: only the bytes matter


@dataclass(frozen=True)
class StepResult:
    finished: list[Any]
    preempted: list[Any]


class HybridLayout:
    """A hybrid-model cache layout on a meta ``KVArena`` (see the module doc).

    ``admit(request) -> bool``  all or nothing; ``step() -> StepResult``; ``stats()``;
    ``close()`` returns whatever the layout holds for itself (``fixed_dual``'s pools)."""

    name: ClassVar[str]
    block_size: int  # tokens per KV unit

    def __init__(self, geometry: HybridGeometry, capacity: int | str) -> None:
        if not isinstance(geometry, HybridGeometry):
            raise InvalidArgumentError(
                f"geometry must be a HybridGeometry, got {type(geometry).__name__}"
            )
        self.geometry = geometry
        self.capacity_bytes = parse_bytes("capacity", capacity)
        self.arena = KVArena(self.capacity_bytes, device="meta", dtype=_ARENA_DTYPE)
        self.itemsize = self.arena.itemsize
        self.running: dict[Any, _Sequence] = {}  # request -> sequence, in admission order
        self.generated: dict[Any, int] = {}  # preempted request -> tokens it had generated
        self.step_count = 0
        self.total_tokens = 0  # sum over running sequences of tokens held
        self.preemptions = 0
        self._admissions = 0
        self._grow_due: dict[int, list[_Sequence]] = {}
        self._finish_due: dict[int, list[_Sequence]] = {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(geometry={self.geometry.name!r}, "
            f"capacity={self.capacity_bytes}, running={len(self.running)})"
        )

    def _elements(self, nbytes: int) -> int:
        if nbytes % self.itemsize:
            raise InvalidArgumentError(
                f"page sizes must be whole {self.itemsize}-byte arena elements, got {nbytes} bytes"
            )
        return nbytes // self.itemsize

    # ------------------------------------------------------------------ the state machine
    def admit(self, request: LengthRequest) -> bool:
        """Take the request's state pages and its prompt's KV, or nothing (False)."""
        if request in self.running:
            raise InvalidArgumentError(f"request {request!r} is already running")
        done = self.generated.get(request, 0)
        prompt = check_positive_int("request.prompt_tokens", request.prompt_tokens) + done
        remaining = check_positive_int("request.output_tokens", request.output_tokens) - done
        seq = _Sequence(request, self._admissions, prompt, remaining, self.step_count, done)
        if not self._take_admission(seq):
            return False
        self._admissions += 1
        self.generated.pop(request, None)
        self.running[request] = seq
        self.total_tokens += prompt
        self._schedule(seq)
        self._finish_due.setdefault(seq.admitted_step + remaining, []).append(seq)
        return True

    def step(self) -> StepResult:
        """Every running sequence decodes one token: first the sequences whose token starts a
        new unit take it (oldest first; if none is free the youngest running sequence is
        preempted, possibly the one asking), then finished sequences free everything."""
        self.step_count += 1
        preempted: list[Any] = []
        for seq in sorted(self._due_growth(), key=lambda s: s.order):
            while self.running.get(seq.request) is seq and not self._take_unit(seq):
                victim = next(reversed(self.running.values()))
                self._preempt(victim)
                preempted.append(victim.request)
            if self.running.get(seq.request) is seq:
                self._schedule(seq)
        self.total_tokens += len(self.running)
        finished = []
        for seq in self._finish_due.pop(self.step_count, []):
            if self.running.get(seq.request) is seq:
                self._release(seq)
                finished.append(seq.request)
        return StepResult(finished, preempted)

    def _due_growth(self) -> Iterable[_Sequence]:
        return self._grow_due.pop(self.step_count, [])

    def _schedule(self, seq: _Sequence) -> None:
        """Queue the step at which ``seq`` needs its next unit: the step that appends token
        number units * block_size (counted from 0), unless it finishes before."""
        step = seq.admitted_step + seq.units * self.block_size - seq.prompt + 1
        if step <= seq.admitted_step + seq.remaining:
            self._grow_due.setdefault(step, []).append(seq)

    def _preempt(self, seq: _Sequence) -> None:
        # It is evicted before it appends this step's token: it holds what it had after the
        # previous step, and is readmitted later with those tokens as its prompt.
        self.generated[seq.request] = seq.generated_before + (
            self.step_count - 1 - seq.admitted_step
        )
        self.total_tokens -= seq.tokens_at(self.step_count - 1)
        self.preemptions += 1
        self._release_pages(seq)
        del self.running[seq.request]

    def _release(self, seq: _Sequence) -> None:
        self.total_tokens -= seq.tokens_at(self.step_count)
        self._release_pages(seq)
        del self.running[seq.request]

    # ------------------------------------------------------------------ per-layout pages
    def _take_admission(self, seq: _Sequence) -> bool:
        raise NotImplementedError

    def _take_unit(self, seq: _Sequence) -> bool:
        raise NotImplementedError

    def _release_pages(self, seq: _Sequence) -> None:
        raise NotImplementedError

    def _reserved_bytes(self) -> tuple[int, int]:
        """(bytes held for KV, bytes held for states) by running sequences."""
        raise NotImplementedError

    def close(self) -> None:
        """Give back what the layout holds beyond its sequences (nothing by default)."""

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, float]:
        """Bytes, all of the ``capacity_bytes`` budget. ``live_*`` hold data (KV of the tokens
        held, exact states); ``reserved_*`` are held for running sequences (pages, or slots);
        ``unused`` = capacity - live: partly filled blocks, padding, and free space (for
        ``fixed_dual`` also the free part of the pool the workload is not short of)."""
        g = self.geometry
        live_kv = self.total_tokens * g.kv_token_bytes * g.attention_layers
        live_state = len(self.running) * g.state_bytes_per_sequence
        reserved_kv, reserved_state = self._reserved_bytes()
        unused = self.capacity_bytes - live_kv - live_state
        return {
            "capacity_bytes": self.capacity_bytes,
            "running": len(self.running),
            "tokens": self.total_tokens,
            "live_kv_bytes": live_kv,
            "live_state_bytes": live_state,
            "reserved_kv_bytes": reserved_kv,
            "reserved_state_bytes": reserved_state,
            "kv_slack_bytes": reserved_kv - live_kv,
            "state_padding_bytes": reserved_state - live_state,
            "free_bytes": self.capacity_bytes - reserved_kv - reserved_state,
            "unused_bytes": unused,
            "waste": unused / self.capacity_bytes,
            "preemptions": self.preemptions,
        }


class _PagedLayout(HybridLayout):
    """Layouts whose every unit is an arena page: a KV block of ``block_size`` tokens is
    ``kv_pages_per_block`` pages of ``kv_page_elements`` (one per attention layer, or one with
    a layer axis), and a sequence's states are ``state_pages_per_sequence`` pages of
    ``state_page_elements``."""

    kv_page_elements: int
    kv_pages_per_block: int  # pages per block of block_size tokens (one per layer, or 1)
    kv_align: int
    state_page_elements: int
    state_pages_per_sequence: int
    state_align: int

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _take_admission(self, seq: _Sequence) -> bool:
        blocks = self._blocks_for(seq.prompt)
        kv_count, kv_size = blocks * self.kv_pages_per_block, self.kv_page_elements
        state_count, state_size = self.state_pages_per_sequence, self.state_page_elements
        free = self.arena.capacity - sum(self.arena.used.values())
        if kv_count * kv_size + state_count * state_size > free:
            return False  # not enough free in total: no need to try (and compact)
        try:
            seq.state_pages = self.arena.allocate(
                seq, "state", state_size, state_count, align=self.state_align
            )
        except ArenaExhausted:
            return False
        try:
            seq.kv_pages = self.arena.allocate(seq, "kv", kv_size, kv_count, align=self.kv_align)
        except ArenaExhausted:
            self.arena.free(seq.state_pages)  # all or nothing (L1)
            seq.state_pages = []
            return False
        seq.units = blocks
        return True

    def _take_unit(self, seq: _Sequence) -> bool:
        try:
            pages = self.arena.allocate(
                seq, "kv", self.kv_page_elements, self.kv_pages_per_block, align=self.kv_align
            )
        except ArenaExhausted:
            return False
        seq.kv_pages += pages
        seq.units += 1
        return True

    def _release_pages(self, seq: _Sequence) -> None:
        self.arena.free(seq.kv_pages + seq.state_pages)
        seq.kv_pages, seq.state_pages = [], []

    def _reserved_bytes(self) -> tuple[int, int]:
        return self.arena.used["kv"] * self.itemsize, self.arena.used["state"] * self.itemsize


class KVStackLayout(_PagedLayout):
    """Ours: one arena; KV blocks of ``block_size`` (16) tokens, aligned to their own size (as
    ``ArenaBlockPool`` addresses them); exact-size state pages, which the arena places from
    the top. Both kinds share the free space, and the arena compacts when a page does not fit
    but enough is free in total.

    ``layer_axis=True`` (the default) gives each page a layer axis, as DESIGN's "one pool with
    a layer axis": one KV page holds a block of every attention layer, one state page every
    state layer's state of the sequence. The bytes are the same as per-layer pages
    (``layer_axis=False``); the arena has far fewer pages to place and compact, and its
    compaction walks every page."""

    name = "kvstack"

    def __init__(
        self,
        geometry: HybridGeometry,
        capacity: int | str,
        block_size: int = KVSTACK_BLOCK_SIZE,
        layer_axis: bool = True,
    ) -> None:
        super().__init__(geometry, capacity)
        self.block_size = check_positive_int("block_size", block_size)
        # With a layer axis a page holds that block (that state) of every layer at once: the
        # same bytes, and far fewer pages for the arena to place and compact.
        kv_layers = geometry.attention_layers if layer_axis else 1
        state_layers = geometry.state_layers if layer_axis else 1
        self.kv_page_elements = self._elements(kv_layers * block_size * geometry.kv_token_bytes)
        self.kv_pages_per_block = geometry.attention_layers // kv_layers
        self.kv_align = self.kv_page_elements  # a block id is offset // block elements
        self.state_page_elements = self._elements(state_layers * geometry.state_page_bytes)
        self.state_pages_per_sequence = geometry.state_layers // state_layers
        self.state_align = 1  # exact size, no padding (L3)


class PaddedUnifiedLayout(_PagedLayout):
    """vLLM's unified pool: every page is P bytes (``vllm_page_bytes``): an attention block of
    ``vllm_attention_block_size`` tokens of one layer, or one layer's state padded to P. The
    pages are block-pool slots: aligned to P, like vLLM's block ids into one tensor. (vLLM
    allocates block ids per group of layers; for these models every layer count divides the
    group size, so per-layer pages hold the same bytes.)"""

    name = "padded_unified"

    def __init__(
        self,
        geometry: HybridGeometry,
        capacity: int | str,
        alignment: int = VLLM_KERNEL_BLOCK_ALIGNMENT,
    ) -> None:
        super().__init__(geometry, capacity)
        self.block_size = vllm_attention_block_size(geometry, alignment)
        self.page_bytes = vllm_page_bytes(geometry, alignment)
        self.kv_page_elements = self.state_page_elements = self._elements(self.page_bytes)
        self.kv_pages_per_block = geometry.attention_layers
        self.state_pages_per_sequence = geometry.state_layers
        self.kv_align = self.state_align = self.kv_page_elements


class FixedDualLayout(HybridLayout):
    """SGLang's two pools (``sglang_pool_split``). Like SGLang, both pools are allocated once
    at start-up, here as two arena pages (a "state" page of ``state_slots`` request states and
    a "kv" page of ``kv_tokens`` token slots) that never change; requests take slots inside
    them: one state slot (every state layer, exact size) and one token slot per token, in pages
    of ``page_size`` tokens (SGLang's ``--page-size``, default 1). A slot is any free one, so
    each pool is a free count, as SGLang's allocators' free lists are.

    Modelled with the radix cache off: SGLang's default keeps up to 3 state slots per running
    request for prefix reuse (``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO``), which would
    only lower the requests that fit; the trace has no shared prefixes to reuse."""

    name = "fixed_dual"

    def __init__(
        self,
        geometry: HybridGeometry,
        capacity: int | str,
        ratio: float = SGLANG_MAMBA_FULL_MEMORY_RATIO,
        page_size: int = SGLANG_PAGE_SIZE,
    ) -> None:
        super().__init__(geometry, capacity)
        self.block_size = check_positive_int("page_size", page_size)
        self.ratio = ratio
        self.split = sglang_pool_split(self.capacity_bytes, geometry, ratio, page_size)
        if self.split.state_slots == 0 or self.split.kv_tokens == 0:
            raise InvalidArgumentError(
                f"capacity={self.capacity_bytes} bytes at ratio={ratio} leaves "
                f"{self.split.state_slots} state slots and {self.split.kv_tokens} KV tokens; "
                "expected at least one of each"
            )
        self._cell = geometry.kv_token_bytes * geometry.attention_layers
        self._pool_pages = self.arena.allocate(
            self, "state", self._elements(self.split.state_pool_bytes)
        ) + self.arena.allocate(self, "kv", self._elements(self.split.kv_pool_bytes))
        self.free_state_slots = self.split.state_slots
        self.free_kv_pages = self.split.kv_tokens // page_size

    def pages_moved(self, moves: dict[Page, int]) -> None:
        pass

    def _take_admission(self, seq: _Sequence) -> bool:
        pages = math.ceil(seq.prompt / self.block_size)
        if self.free_state_slots < 1 or self.free_kv_pages < pages:
            return False
        self.free_state_slots -= 1
        self.free_kv_pages -= pages
        seq.units = pages
        return True

    def _take_unit(self, seq: _Sequence) -> bool:
        if self.free_kv_pages < 1:
            return False
        self.free_kv_pages -= 1
        seq.units += 1
        return True

    def _due_growth(self) -> Iterable[_Sequence]:
        if self.block_size != 1:
            return super()._due_growth()
        # Token-granular: every running sequence takes one slot every step. When enough are
        # free, take them all at once instead of one by one (same result, no per-token work).
        if self.free_kv_pages >= len(self.running):
            self.free_kv_pages -= len(self.running)
            for seq in self.running.values():
                seq.units += 1
            return []
        return list(self.running.values())

    def _schedule(self, seq: _Sequence) -> None:
        if self.block_size != 1:
            super()._schedule(seq)  # token-granular growth is every step (``_due_growth``)

    def _release_pages(self, seq: _Sequence) -> None:
        self.free_state_slots += 1
        self.free_kv_pages += seq.units
        seq.units = 0

    def _reserved_bytes(self) -> tuple[int, int]:
        used_pages = self.split.kv_tokens // self.block_size - self.free_kv_pages
        used_slots = self.split.state_slots - self.free_state_slots
        return (
            used_pages * self.block_size * self._cell,
            used_slots * self.geometry.state_bytes_per_sequence,
        )

    def stats(self) -> dict[str, float]:
        stats = super().stats()
        reserved_kv, reserved_state = self._reserved_bytes()
        stats["free_kv_pool_bytes"] = self.split.kv_pool_bytes - reserved_kv
        stats["free_state_pool_bytes"] = self.split.state_pool_bytes - reserved_state
        return stats

    def close(self) -> None:
        if self.running:
            raise InvalidArgumentError(
                f"close() needs every sequence finished, {len(self.running)} still running"
            )
        if self._pool_pages:
            self.arena.free(self._pool_pages)
            self._pool_pages = []


def make_layout(name: str, geometry: HybridGeometry, capacity: int | str) -> HybridLayout:
    """The layout called ``name`` (one of ``LAYOUTS``) with its system's defaults."""
    layouts = {
        "padded_unified": PaddedUnifiedLayout,
        "fixed_dual": FixedDualLayout,
        "kvstack": KVStackLayout,
    }
    if name not in layouts:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {name!r}")
    return layouts[name](geometry, capacity)


# --------------------------------------------------------------------------- a trace
class TimedRequest(LengthRequest, Protocol):
    @property
    def arrival_step(self) -> int: ...


@dataclass
class TraceResult:
    """What ``run_trace`` saw.

    The *peak* is the first step, among the memory-bound ones (admission stopped because the
    head of the queue did not fit, not because the queue was empty), with the most resident
    sequences: that count is ``max_sequences``, and ``peak`` is ``stats()`` then (after
    admission, before the step's decode). ``max_resident`` is the most resident at any step,
    memory-bound or not. ``saturated`` is False when no step was memory-bound (the trace never
    filled the layout; then ``max_sequences`` is 0 and ``peak`` is the final stats)."""

    max_sequences: int = 0
    peak_step: int = 0
    peak: dict[str, float] = field(default_factory=dict)
    saturated: bool = False
    max_resident: int = 0
    memory_bound_steps: int = 0
    steps: int = 0
    admissions: int = 0
    finished: int = 0
    preemptions: int = 0


def run_trace(layout: HybridLayout, trace: Sequence[TimedRequest]) -> TraceResult:
    """Serve ``trace`` (requests arrive at their ``arrival_step``) first come, first served.
    Every step: arrivals join the queue; unless the previous step preempted, queued requests
    are admitted from the head until one does not fit (vLLM's FCFS stops there too); the peak
    is updated; every running sequence decodes (``step``); preempted requests go back to the
    head of the queue, oldest first."""
    pending = deque(sorted(trace, key=lambda r: r.arrival_step))
    waiting: deque[Any] = deque()
    result = TraceResult()
    preempted_now = False
    while pending or waiting or layout.running:
        while pending and pending[0].arrival_step <= layout.step_count:
            waiting.append(pending.popleft())
        refused = False
        if not preempted_now:
            while waiting:
                if not layout.admit(waiting[0]):
                    refused = True
                    break
                waiting.popleft()
                result.admissions += 1
        if refused and not layout.running:
            head = waiting[0]
            raise InvalidArgumentError(
                f"request with prompt_tokens={head.prompt_tokens}, output_tokens="
                f"{head.output_tokens} does not fit an empty {layout.name} layout of "
                f"{layout.capacity_bytes} bytes"
            )
        resident = len(layout.running)
        result.max_resident = max(result.max_resident, resident)
        if refused:
            result.memory_bound_steps += 1
            if resident > result.max_sequences:
                result.max_sequences, result.peak_step = resident, layout.step_count
                result.peak, result.saturated = layout.stats(), True
        if not layout.running:
            if waiting:  # everything was preempted: admit again at the next pass
                preempted_now = False
            else:  # idle until the next arrival
                layout.step_count = pending[0].arrival_step
            continue
        step = layout.step()
        result.finished += len(step.finished)
        waiting.extendleft(step.preempted)  # the youngest went first: the oldest ends at the head
        preempted_now = bool(step.preempted)
    result.steps, result.preemptions = layout.step_count, layout.preemptions
    if not result.saturated:
        result.peak = layout.stats()
    return result
