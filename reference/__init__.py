"""kvstack.reference — the executable specification.

Plain PyTorch, one module per mechanism, each stating its invariants in its docstring:

    block_pool   paged K/V storage, free list, reference counts, atomic allocation
    token_table  logical token -> physical slot, liveness, original position (vToken)
    repack       waste metric, repack planner and executor (vToken I1-I4)
    attention    attention over token tables for decode and prefill chunks, with LSE
    ragged       decode attention over head groups' page tables, run from a static work list
                 (Tangram)
    merge        merge of attention states by log-sum-exp; multi-segment attention (AsymCache)
    rope         chunked RoPE: rotate pre-RoPE keys, re-rotate stored keys (InferScale)
    arena        one memory budget: KV and state pages, compaction, private arenas (KVArena)
    arena_layouts  hybrid-model memory layouts: vLLM's padded unified pages, SGLang's dual
                 pools, kvstack's arena, on a request trace

Nothing here imports from kvstack.compiled or kvstack.cuda_kernels.
"""

from kvstack.reference.attention import AttentionOutput, decode_attention, paged_attention
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.merge import merge_attention_states, multi_segment_attention
from kvstack.reference.ragged import ragged_decode_attention
from kvstack.reference.repack import RepackPlan, copy_slots, execute_repack, plan_repack
from kvstack.reference.rope import apply_rotary, rerotate_keys, rotate_keys
from kvstack.reference.token_table import TokenTable

__all__ = [
    "AttentionOutput",
    "BlockPool",
    "RepackPlan",
    "TokenTable",
    "apply_rotary",
    "copy_slots",
    "decode_attention",
    "execute_repack",
    "merge_attention_states",
    "multi_segment_attention",
    "paged_attention",
    "plan_repack",
    "ragged_decode_attention",
    "rerotate_keys",
    "rotate_keys",
]
