"""Ragged decode attention: head groups' page tables, read split by split from a static work
list (Tangram).

Tangram's layout (``kvstack.head_groups``): a layer's KV heads are chunked into G groups of up to
H_p heads, and each group of each sequence has one page table sized by the group's largest
budget. A slot of that table holds H_p entries, one per member head (member i at index i of the
pool's head dimension), and every member keeps its own tokens: member i's live entries are the
table's first ``lengths[b, g, i]`` slots, so a member with a smaller budget leaves the tail of
its column empty (the group's over-allocation).

Inputs (B sequences, one query token each):

    query        [B, 1, H_q, D]
    key_cache    [num_blocks, block_size, H_p, D]   the groups' pool
    value_cache  [num_blocks, block_size, H_p, D]
    slots        [B, G, T] int     each (sequence, group)'s table in order, -1 = padding
    lengths      [B, G, H_p] int   member i of group g of sequence b reads slots[b, g, :lengths]
    members      [G, H_p] int      the KV head of each member, -1 = none (a short group)
    work         [W, 3] int        the work list: rows (group, part, parts)

Rule: work row (g, p, n) is split p of n of group g's table. For sequence b it reads the table
positions [p * U // n, (p + 1) * U // n), U = max_i lengths[b, g, i] (the table's used length),
each member only below its own length; it gives every query head of its members a partial state
(out, lse) over those keys (``attention.py``'s rule: float32 scores, natural log). A query
head's result is the log-sum-exp merge (``merge.py``) of the partial states of its KV head's
group. Query head h reads KV head h // (H_q / H_kv), H_kv the number of members that are heads.

The list must give every group the parts 0 .. n-1 of one n, each once: then a group's splits
tile its tables, and the result is attention over each head's live entries whatever the list
holds. How many splits a group gets is a schedule (``kvstack.head_groups.plan_ahead_of_time``
balances them over workers once, from the profile), never a change of meaning; the property
tests hold every implementation to that. A head with no live entries gets out = 0, lse = -inf.
Returns ``AttentionOutput(out [B, 1, H_q, D] in the query's dtype, lse [B, 1, H_q] float32,
None)``.
"""

from __future__ import annotations

import math

import torch

from kvstack.errors import InvalidArgumentError, SlotOutOfRangeError
from kvstack.reference.attention import INDEX_DTYPES, AttentionOutput
from kvstack.reference.checks import FLOAT_DTYPES, check_tensor
from kvstack.reference.merge import merge_attention_states


def check_ragged_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    members: torch.Tensor,
    work: torch.Tensor,
) -> None:
    """Shape, dtype, device and content checks shared by every implementation."""
    check_tensor("query", query, ndim=4, dtypes=FLOAT_DTYPES)
    batch, t_q, h_q, head_dim = query.shape
    if t_q != 1:
        raise InvalidArgumentError(
            f"query has {t_q} tokens per sequence, expected 1 (ragged_decode_attention is the "
            "decode step)"
        )
    device = query.device
    check_tensor("key_cache", key_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device)
    h_p = key_cache.shape[2]
    check_tensor("key_cache", key_cache, shape=(None, None, h_p, head_dim))
    check_tensor(
        "value_cache", value_cache, shape=tuple(key_cache.shape), dtypes=FLOAT_DTYPES, device=device
    )
    check_tensor("slots", slots, ndim=3, dtypes=INDEX_DTYPES, device=device)
    check_tensor("slots", slots, shape=(batch, None, None))
    groups, table_len = slots.shape[1], slots.shape[2]
    check_tensor("lengths", lengths, shape=(batch, groups, h_p), dtypes=INDEX_DTYPES, device=device)
    check_tensor("members", members, shape=(groups, h_p), dtypes=INDEX_DTYPES, device=device)
    check_tensor("work", work, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_tensor("work", work, shape=(None, 3))

    heads = sorted(int(head) for head in members.flatten() if head >= 0)
    if heads != list(range(len(heads))) or not heads or int(members.min()) < -1:
        raise InvalidArgumentError(
            f"members must name each KV head 0 .. H_kv-1 once (-1 for an empty member), got "
            f"{members.tolist()}"
        )
    if h_q % len(heads):
        raise InvalidArgumentError(
            f"query has {h_q} heads, which is not a multiple of the {len(heads)} KV heads that "
            "members names"
        )
    if lengths.numel():
        if int(lengths.min()) < 0 or int(lengths.max()) > table_len:
            raise InvalidArgumentError(
                f"lengths holds values in [{int(lengths.min())}, {int(lengths.max())}], expected "
                f"0 <= length <= {table_len} (the tables' width)"
            )
        if bool((lengths[:, members < 0] != 0).any()):
            raise InvalidArgumentError(
                "lengths gives entries to a member that is no head (members -1), expected 0"
            )
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    used = lengths.amax(dim=2, keepdim=True) if lengths.numel() else lengths[..., :1]  # [B, G, 1]
    read = torch.arange(table_len, device=device) < used  # [B, G, T]: what some member reads
    if bool(read.any()):
        read_slots = slots[read]
        if int(read_slots.min()) < 0 or int(read_slots.max()) >= num_slots:
            raise SlotOutOfRangeError(
                f"slots holds values in [{int(read_slots.min())}, {int(read_slots.max())}] "
                f"where members read, expected 0 <= slot < {num_slots}"
            )

    parts_of: dict[int, list[tuple[int, int]]] = {}
    for group, part, parts in work.tolist():
        if not 0 <= group < groups:
            raise InvalidArgumentError(f"work names group {group}, expected 0 <= group < {groups}")
        parts_of.setdefault(group, []).append((part, parts))
    for group in range(groups):
        rows = sorted(parts_of.get(group, []))
        count = rows[0][1] if rows else 0
        if count < 1 or rows != [(part, count) for part in range(count)]:
            raise InvalidArgumentError(
                f"work gives group {group} the (part, parts) rows {rows}, expected parts "
                "0 .. n-1 of one n >= 1, each once"
            )


def ragged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    members: torch.Tensor,
    work: torch.Tensor,
    *,
    scale: float | None = None,
    check: bool = True,
) -> AttentionOutput:
    """One decode step over the groups' tables, split by split as ``work`` lists (module doc).
    ``check=False`` skips ``check_ragged_args`` for a caller that built the arguments from its
    own tables; attention changes no state either way."""
    if check:
        check_ragged_args(query, key_cache, value_cache, slots, lengths, members, work)
    batch, _, h_q, head_dim = query.shape
    h_p = key_cache.shape[2]
    h_kv = int((members >= 0).sum())
    per_kv = h_q // h_kv  # query heads per KV head
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    key_rows = key_cache.reshape(-1, h_p, head_dim)  # [S, H_p, D]
    value_rows = value_cache.reshape(-1, h_p, head_dim)

    # The partial states of every (sequence, query head), one per split of its group.
    partial_out = [[[] for _ in range(h_q)] for _ in range(batch)]
    partial_lse = [[[] for _ in range(h_q)] for _ in range(batch)]
    for group, part, parts in work.tolist():
        for b in range(batch):
            used = int(lengths[b, group].max())
            start, end = part * used // parts, (part + 1) * used // parts
            for member, kv_head in enumerate(members[group].tolist()):
                if kv_head < 0:
                    continue
                stop = max(start, min(end, int(lengths[b, group, member])))
                table = slots[b, group, start:stop]  # the member's keys in this split
                keys = key_rows[table, member].float()  # [L, D]
                values = value_rows[table, member].float()
                for h in range(kv_head * per_kv, (kv_head + 1) * per_kv):
                    scores = scale * (keys @ query[b, 0, h].float())  # [L]
                    if len(table):
                        lse = torch.logsumexp(scores, dim=0)
                        out = torch.softmax(scores, dim=0) @ values  # [D]
                    else:  # an empty split: the merge's identity
                        lse = torch.tensor(-math.inf, device=query.device)
                        out = torch.zeros(head_dim, device=query.device)
                    partial_out[b][h].append(out[None])  # [1, D]: one "head" for the merge
                    partial_lse[b][h].append(lse[None])  # [1]

    out = torch.zeros(batch, 1, h_q, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((batch, 1, h_q), -math.inf, dtype=torch.float32, device=query.device)
    for b in range(batch):
        for h in range(h_q):
            merged_out, merged_lse = merge_attention_states(partial_out[b][h], partial_lse[b][h])
            out[b, 0, h], lse[b, 0, h] = merged_out[0], merged_lse[0]
    return AttentionOutput(out.to(query.dtype), lse, None)
