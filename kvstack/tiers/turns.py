"""Conversations' K/V kept between their turns in a byte budget, evicted without loss
(AsymCache's multi-turn reuse, on PersistentKV's tiers).

A turn on the engine (``Engine.submit(keep_kv=True)``) ends with its K/V copied out of the
arena. ``TurnStore.save`` cuts it into pages of ``block_size`` tokens (one page: every layer's
K/V of one block) and keeps them in a ``TieredStore``: host memory, and optionally a disk tier
below it. When the budget runs out the store drops pages from every tier, in its eviction
rule's order. It keeps their tokens, so nothing is lost.

The next turn's prompt starts with the conversation so far. ``TurnStore.prefix_kv`` gives the
K/V of as much of it as the store can rebuild, for ``Engine.submit(prefix_kv=...)``:

* pages it holds are read (from host, or from disk with their checksums checked; a page that
  fails its checksum is dropped and counts as dropped);
* a run of dropped pages before the last page it holds (a hole) is recomputed: one forward
  over the run's tokens on a ``DynamicCache`` holding everything before it. Its cost grows with
  its position, since every token attends to all tokens before it;
* dropped pages after the last page it holds are left out: the engine computes their tokens
  with the rest of the prompt, batched with its other work.

So dropping a page costs its own recompute, wherever it is, and the rules rank pages as they
should:

* ``TailFirstLRU`` (the baseline): the least recently used page first. A lookup reads a
  conversation's pages last to first, and ties go tail first, so a conversation loses its last
  page first, as vLLM's prefix cache frees a sequence's blocks.
* ``CostAware`` (AsymCache): the smallest reuse probability × recompute cost first, so early
  pages, which attend to little, go before late ones.

Holes are recomputed here, one request at a time, not batched in the engine. Lossless caches on
models whose layers are all full attention only (the engine's ``keep_kv`` and ``prefix_kv``).
One thread at a time: the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvstack.errors import InvalidArgumentError, PageCorrupted
from kvstack.serve.request import token_ids
from kvstack.tiers.disk import MAX_KEY_CHARS, check_key, page_file_bytes
from kvstack.tiers.eviction import LRU, EvictionRule, PageInfo
from kvstack.tiers.store import TieredStore
from kvstack.transformers_compat import cache_keyword

MAX_PAGES = 10**9  # pages a conversation may hold: its names are checked up to this index


class _RankOnly:
    """A rule with only its ``rank``: the store then prices each drop alone. (``CostAware``'s
    ``rank_drops`` prices a drop by the one recompute span of a single sequence's dropped
    pages; here a hole is recomputed on its own and pages belong to many conversations.)"""

    def __init__(self, rule: EvictionRule) -> None:
        self.rule = rule

    def rank(self, pages: Sequence[PageInfo], now: int, demote_to: str | None) -> list[PageInfo]:
        return self.rule.rank(pages, now, demote_to)


class TailFirstLRU(LRU):
    """LRU whose ties go to the page latest in its sequence: of pages used at the same time,
    the tail leaves first, and the head, which every later page needs, stays."""

    def rank(self, pages: Sequence[PageInfo], now: int, demote_to: str | None) -> list[PageInfo]:
        return sorted(pages, key=lambda p: (p.last_used, -p.position, p.key))


@dataclass
class TurnStats:
    """What the store's lookups gave, in tokens of the prompts they were asked for."""

    lookups: int = 0
    reused_tokens: int = 0  # read from a tier
    recomputed_tokens: int = 0  # holes recomputed here
    missed_tokens: int = 0  # of the conversation so far, left for the engine to compute
    read_seconds: float = 0.0
    recompute_seconds: float = 0.0
    pages_written: int = 0


class TurnStore:
    """Pages of conversations' K/V between turns (see the module docstring).

    ``model``: the model the engine serves (its geometry sizes the pages; holes are recomputed
    with it). ``host_bytes``: the host tier's budget, at least one page. ``rule``: the eviction
    rule (default ``TailFirstLRU``). ``disk_path`` and ``disk_bytes``: a disk tier that pages
    spill to before they are dropped (0: none)."""

    def __init__(
        self,
        model: Any,
        *,
        host_bytes: int,
        block_size: int = 16,
        rule: EvictionRule | None = None,
        disk_path: Any = None,
        disk_bytes: int = 0,
    ) -> None:
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types):
            raise InvalidArgumentError(
                f"TurnStore needs a model whose layers are all full attention; this one has "
                f"layer types {sorted(set(layer_types))}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block_size={block_size!r}; expected an int >= 1")
        self.model = model
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        # One page: K and V of every layer for one block, [L, block, H_kv, D] each.
        self.page_bytes = (
            2 * self.layers * block_size * self.kv_heads * self.head_dim * self.dtype.itemsize
        )
        if not isinstance(host_bytes, int) or host_bytes < self.page_bytes:
            raise InvalidArgumentError(
                f"host_bytes={host_bytes!r} cannot hold one page of {self.page_bytes} bytes "
                f"({block_size} tokens of {self.layers} layers); expected at least that"
            )
        # The smallest page file: a page's K/V plus its header and checksum, under the shortest
        # key a conversation gives (a one-character name, page 0). The store refuses a disk
        # budget below it before it makes the tier's directory.
        shape = (self.layers, block_size, self.kv_heads, self.head_dim)  # [L, block, H, D]
        empty = torch.empty(shape, dtype=self.dtype, device="meta")
        page_file = page_file_bytes(self._key("c", 0), {"k": empty, "v": empty})
        self.store = TieredStore(
            device_bytes=0,
            host_bytes=host_bytes,
            disk_path=disk_path,
            disk_bytes=disk_bytes,
            rule=_RankOnly(rule if rule is not None else TailFirstLRU()),
            min_page_bytes=self.page_bytes,
            min_page_file_bytes=page_file,
            may_drop=True,
        )
        if self.store.disk is not None and self.store.disk.keys():
            raise InvalidArgumentError(
                f"disk_path={str(disk_path)!r} holds page files already; expected an empty "
                "directory (a TurnStore's disk tier spills pages, it does not reopen them)"
            )
        self.conversations: dict[str, list[int]] = {}  # the token ids its pages hold
        self.stats = TurnStats()

    def __repr__(self) -> str:
        return (
            f"TurnStore(conversations={len(self.conversations)}, pages={len(self.store.pages)}, "
            f"dropped={len(self.store.dropped)}, host={self.store.bytes_used('host')}/"
            f"{self.store.capacity['host']} bytes, rule={type(self.store.rule.rule).__name__})"
        )

    # ------------------------------------------------------------------ turns
    def save(self, conversation: str, token_ids: Sequence[int], kv: tuple[Any, Any]) -> int:
        """Keep a finished turn's K/V: ``token_ids``, the tokens it computed (its prompt and
        outputs but the last), and ``kv``, their keys and values [L, n, H_kv, D]
        (``request.kept_kv``). Whole pages only: a last partial block is left to the next turn's
        prefill. Pages held for the same tokens stay as they are (with their use counts);
        dropped, changed and new ones are written. Returns the pages written."""
        self._check_conversation(conversation)
        ids = [int(t) for t in token_ids]
        keys, values = self._check_kv(kv, len(ids))
        block = self.block_size
        full = len(ids) // block
        held = self.conversations.get(conversation, [])
        same = _common_prefix(held, ids) // block  # pages whose tokens did not change
        for index in range(same, len(held) // block):  # the conversation went another way
            self.store.delete(self._key(conversation, index))
        self.conversations[conversation] = ids[: same * block]  # what it holds until the end
        written = 0
        self.store.tick()  # a save is a use: its pages are newer than every page before it
        # The pages it keeps were used by this turn too: all of them share the save's time, so
        # of this conversation a tail-first rule drops the tail, not the head the lookup read
        # first.
        kept = [self._key(conversation, i) for i in range(min(same, full))]
        self.store.mark_used([key for key in kept if key in self.store.pages])
        # Last page first: while room is made for page i, the pages after it are candidates
        # too, so a tail-first rule keeps the head (the head page, written last, always stays).
        new_keys: list[str] = []
        revived = []  # records of pages it had dropped, whose K/V this save stores again
        try:
            for index in reversed(range(full)):
                key = self._key(conversation, index)
                if index < same and key in self.store.pages:
                    continue
                if key in self.store.dropped:
                    revived.append(self.store.forget_dropped(key))  # the K/V is here again
                cut = slice(index * block, (index + 1) * block)
                page = {"k": keys[:, cut].contiguous(), "v": values[:, cut].contiguous()}
                self.store.put(key, page, tier="host", position=index * block, tokens=block)
                new_keys.append(key)
        except BaseException:
            # A page that could not be written (a full or failing disk): the conversation keeps
            # the pages before ``same`` that it held (those of a history that changed are
            # deleted above, before any write), and none of this save's. A page it had dropped
            # is dropped again (its tokens are still the conversation's), never lost.
            for key in new_keys:
                if key in self.store.pages or key in self.store.dropped:
                    self.store.delete(key)
            for info in revived:
                self.store.restore_dropped(info)
            raise
        written = len(new_keys)
        self.conversations[conversation] = ids[: full * block]
        self.stats.pages_written += written
        return written

    def prefix_kv(
        self, conversation: str, token_ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K/V for the first tokens of ``token_ids`` (a next turn's prompt) that the store can
        rebuild: the pages it holds, and the holes between them recomputed. At most all but
        the prompt's last token (the engine computes that one, for its logits). None when no
        page of the conversation's matching tokens is held."""
        self._check_conversation(conversation)
        ids = [int(t) for t in token_ids]
        self.stats.lookups += 1
        held = self.conversations.get(conversation, [])
        matching = min(_common_prefix(held, ids), len(ids) - 1)
        count = matching // self.block_size  # whole pages of the prompt the store knows
        start = time.perf_counter()
        pages: dict[int, dict[str, torch.Tensor]] = {}
        homes = self.store.homes([self._key(conversation, i) for i in range(count)])
        for index in reversed(range(count)):  # last to first: LRU sees the head most recent
            key = self._key(conversation, index)
            if homes[key] is None:
                continue
            try:
                pages[index] = self.store.get(key)[0]
            except PageCorrupted:
                self.store.drop(key)  # never read again; its tokens recompute it
        self.stats.read_seconds += time.perf_counter() - start
        usable = max(pages, default=-1) + 1
        self.stats.missed_tokens += max(0, matching - usable * self.block_size)
        if not usable:
            return None
        self.stats.reused_tokens += len(pages) * self.block_size
        index = 0
        while index < usable:  # fill each hole, first to last: a hole needs all before it
            if index in pages:
                index += 1
                continue
            end = index
            while end not in pages:
                end += 1
            self._recompute(ids, index, end, pages)
            index = end
        keys = torch.cat([pages[i]["k"] for i in range(usable)], dim=1)  # [L, n, H_kv, D]
        values = torch.cat([pages[i]["v"] for i in range(usable)], dim=1)
        return keys, values

    def submit(
        self,
        engine: Any,
        conversation: str,
        input_ids: Sequence[int],
        max_new_tokens: int,
        **kwargs,
    ) -> Any:
        """``engine.submit`` of a conversation's next turn (``input_ids``: the conversation so
        far and the new message), with the K/V the store rebuilds as ``prefix_kv`` and
        ``keep_kv=True``. Pass the handle to ``save_turn`` when it is done. Arguments the
        engine would refuse are refused before the store reads anything (a read counts hits, and
        drops a page it finds corrupt)."""
        engine.check_submit(input_ids, max_new_tokens, keep_kv=True, **kwargs)
        ids = token_ids("input_ids", input_ids)
        prefix = self.prefix_kv(conversation, ids)
        return engine.submit(ids, max_new_tokens, prefix_kv=prefix, keep_kv=True, **kwargs)

    def save_turn(self, conversation: str, request: Any) -> int:
        """``save`` of a finished turn submitted with ``keep_kv=True``: the K/V of its prompt
        and outputs. Returns the pages written (0 for a cancelled turn, which kept nothing)."""
        if request.kept_kv is None:
            if request.finish_reason == "cancelled":
                return 0
            raise InvalidArgumentError(
                f"{request!r} kept no K/V; expected a finished request submitted with "
                "keep_kv=True (TurnStore.submit)"
            )
        computed = request.prompt_ids + request.output_ids[:-1]  # the last was never fed back
        return self.save(conversation, computed, request.kept_kv)

    def forget(self, conversation: str) -> None:
        """Delete a conversation's pages (it ended)."""
        self._check_conversation(conversation)
        held = self.conversations.pop(conversation, [])
        for index in range(len(held) // self.block_size):
            key = self._key(conversation, index)
            if key in self.store.pages or key in self.store.dropped:
                self.store.delete(key)

    def bytes_held(self) -> int:
        """The bytes of pages the store holds, host and disk tiers together."""
        return self.store.bytes_used("host") + self.store.bytes_used("disk")

    # ------------------------------------------------------------------ internals
    def _recompute(
        self, ids: list[int], first: int, end: int, pages: dict[int, dict[str, torch.Tensor]]
    ) -> None:
        """Pages ``first`` .. ``end - 1`` into ``pages``: one forward over their tokens on a
        ``DynamicCache`` holding pages 0 .. ``first - 1`` (all in ``pages``)."""
        start = time.perf_counter()
        block = self.block_size
        device = next(self.model.parameters()).device
        cache = DynamicCache(config=self.model.config)
        if first:
            # [L, n, H_kv, D] on the model's device
            keys = torch.cat([pages[i]["k"] for i in range(first)], dim=1).to(device)
            values = torch.cat([pages[i]["v"] for i in range(first)], dim=1).to(device)
            for layer in range(self.layers):
                # [n, H_kv, D] -> [1, H_kv, n, D]: the cache's layout
                cache.update(
                    keys[layer].transpose(0, 1)[None], values[layer].transpose(0, 1)[None], layer
                )
        span = torch.tensor([ids[first * block : end * block]], device=device)  # [1, tokens]
        backbone = getattr(self.model, "base_model", self.model)  # only the K/V are needed
        attention = self.model.config._attn_implementation
        self.model.set_attn_implementation("sdpa")  # the engine's attention needs its step
        try:
            with torch.no_grad():
                backbone(input_ids=span, use_cache=True, **{cache_keyword(backbone): cache})
        finally:
            self.model.set_attn_implementation(attention)
        for index in range(first, end):
            cut = slice(index * block, (index + 1) * block)
            # each layer's [1, H_kv, n, D] -> [L, block, H_kv, D]
            pages[index] = {
                short: torch.stack(
                    [getattr(layer, name)[0, :, cut].transpose(0, 1) for layer in cache.layers]
                ).cpu()  # held pages come from host and disk: the store's pages live on the CPU
                for short, name in (("k", "keys"), ("v", "values"))
            }
        self.stats.recomputed_tokens += (end - first) * block
        self.stats.recompute_seconds += time.perf_counter() - start

    def _check_kv(self, kv: Any, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        expected = (self.layers, tokens, self.kv_heads, self.head_dim)
        if (
            not isinstance(kv, (tuple, list))
            or len(kv) != 2
            or not all(isinstance(t, torch.Tensor) for t in kv)
            or tuple(kv[0].shape) != expected
            or tuple(kv[1].shape) != expected
            or kv[0].dtype != self.dtype
            or kv[1].dtype != self.dtype
        ):
            shapes = (
                [f"{tuple(t.shape)} {t.dtype}" for t in kv]
                if isinstance(kv, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in kv)
                else type(kv).__name__
            )
            raise InvalidArgumentError(
                f"kv is {shapes}; expected (keys, values), each {list(expected)} {self.dtype} "
                f"([layers, tokens, kv_heads, head_dim] for the {tokens} token ids)"
            )
        return kv[0].detach().to("cpu"), kv[1].detach().to("cpu")

    @classmethod
    def _check_conversation(cls, conversation: Any) -> None:
        """Refuse a name whose pages' keys would not all be usable page keys (file names on
        the disk tier), before anything is read or written: the key of the largest page index
        is the longest, so if it passes every other does."""
        if not isinstance(conversation, str) or not conversation:
            raise InvalidArgumentError(
                f"conversation={conversation!r}; expected a non-empty str naming it"
            )
        last = cls._key(conversation, MAX_PAGES - 1)
        try:
            check_key(last)
        except InvalidArgumentError:
            longest = MAX_KEY_CHARS - (len(last) - len(conversation))
            raise InvalidArgumentError(
                f"conversation={conversation!r} cannot name its pages: the key of its page "
                f"{MAX_PAGES - 1}, {last!r}, is not usable as a file name; expected letters, "
                f"digits, '_', '-' or '.', starting with a letter or digit, at most {longest} "
                "characters"
            ) from None

    @staticmethod
    def _key(conversation: str, index: int) -> str:
        return f"{conversation}.{index}"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count
