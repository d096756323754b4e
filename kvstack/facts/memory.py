"""``FactMemory``: each fact's KV computed once, retrieved by embedding, and injected at the
positions a prompt gives it instead of prefilling its text again (InferScale).

    memory = FactMemory(model, tokenizer, context_turns=5, path="memory")
    memory.add("Alice's dog is named Biscuit.", context=turns_so_far)
    ids = memory.retrieve("What is Alice's dog called?", k=5)
    cache, input_ids = memory.build_cache(header, ids, question)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)

**Context-window encoding.** A fact is encoded after the ``context_turns`` (w) conversation
turns before it, in one forward pass; only the fact's K/V is kept. w = 0 encodes the fact alone.

**Chunked RoPE.** The kept keys are rotated at the positions they had in that pass; they are
stored re-rotated to position 0 (``rerotate_keys`` by minus their positions: a pure rotation,
so the model's ``attention_scaling`` stays in them as the model put it there), and injected by
re-rotating them to the positions the assembled prompt gives them. Both rotations use the
model's own rotary embedding, so this is exact for default, linear, llama3 and yarn RoPE (any
whose frequencies do not depend on the sequence length). Values carry no position. Refused at
construction: "dynamic" and "longrope" RoPE (their frequencies follow the length of each forward
pass, so the turn a key got in its encoding pass is not the one its prompt would give it) and
partial rotary (``partial_rotary_factor`` < 1: ``rerotate_keys`` turns every dimension).

**Storage.** Each fact's K/V is one page of a ``KVArena`` (the memory's own, growing in
segments, or one shared with the caches that serve the requests): stored once, read by every
prompt that retrieves the fact, and counted in the arena's real bytes (``bytes_held``).

**The assembled prompt** is token ids: ``header`` + each fact's tokens + ``question``, where a
fact's tokens (and a context turn's) are its text plus a newline, tokenized alone. The same ids
prefilled as text are the baseline (``prompt_ids``); with every fact encoded after everything
before it (w covering it all), injection reproduces that prefill up to float rounding.

Models: decoder-only with full attention in every layer and a Hugging Face rotary embedding
(Llama, Qwen2/3, Mistral without a window, SmolLM2). Caches: ``DynamicCache`` and kvstack's
lossless ``PagedCache`` (on the memory's arena or any other).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvstack import ops
from kvstack.arena import KVArena, Page
from kvstack.errors import InvalidArgumentError, KVStackError, StoreCorrupted
from kvstack.facts import storage
from kvstack.facts.embedding import MiniLMEmbedder, cosine_top_k, embed
from kvstack.transformers_compat import cache_keyword


@dataclass(frozen=True)
class Fact:
    id: str
    text: str
    token_ids: tuple[int, ...]  # its tokens in an assembled prompt: text + newline, alone
    context_tokens: int  # tokens it was encoded after (the prefix and its turns)


def rotate_keys_by(keys: torch.Tensor, positions: torch.Tensor, rotary: Any) -> torch.Tensor:
    """Keys [L, T, H_kv, D], each token's turned by its entry of ``positions`` [T] (negative:
    back towards 0) with the model's rotary module: one ``rerotate_keys`` call for every layer
    and head, which turn by the same angle. Returns [L, T, H_kv, D]."""
    layers, count, heads, head_dim = keys.shape
    flat = keys.transpose(0, 1).reshape(count, layers * heads, head_dim)  # [T, L * H_kv, D]
    turned = ops.get("rerotate_keys")(flat, positions, rotary)
    return turned.reshape(count, layers, heads, head_dim).transpose(0, 1)


def rope_refusal(config: Any, rotary: Any = None) -> str | None:
    """Why keys rotated by the RoPE of ``config`` (a text config; ``rotary``: its rotary module,
    when there is one) cannot be re-rotated exactly; None when they can. Transformers 5 spells
    the parameters ``config.rope_parameters`` (``rope_scaling`` before; ``type`` for
    ``rope_type`` in older configs); the module's own ``rope_type`` is what it runs."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    parameters = parameters if isinstance(parameters, dict) else {}
    rope_type = getattr(rotary, "rope_type", None) or parameters.get(
        "rope_type", parameters.get("type", "default")
    )
    if not isinstance(rope_type, str):  # one RoPE per layer type: windowed layers, refused too
        return f"rope_type={rope_type!r} differs by layer type; expected one RoPE for every layer"
    # Transformers' own test for a length-dependent update (dynamic_rope_update) is this one.
    if "dynamic" in rope_type or rope_type == "longrope":
        return (
            f"rope_type={rope_type!r}: its frequencies depend on the sequence length, so a key "
            "rotated in its encoding pass cannot be re-rotated exactly to a prompt's position; "
            "expected a RoPE with fixed frequencies (default, linear, llama3, yarn)"
        )
    factor = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = getattr(rotary, "inv_freq", None)
    rotary_dim = head_dim if inv_freq is None else 2 * inv_freq.numel()
    if (factor is not None and factor < 1) or rotary_dim < head_dim:
        return (
            f"partial rotary (rope_type={rope_type!r}, partial_rotary_factor={factor!r}: "
            f"{rotary_dim} of head_dim {head_dim} dimensions rotated); expected every dimension "
            "rotated, which is what re-rotating the stored keys does"
        )
    return None


def _rotary(model: Any) -> torch.nn.Module:
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "inv_freq", None) is None:
        raise KVStackError(
            f"{type(model).__name__} has no Hugging Face rotary embedding at model.rotary_emb; "
            "FactMemory re-rotates keys with the model's own RoPE"
        )
    return rotary


# Elements of each parameter the identity hashes, evenly spaced: a different checkpoint (a
# fine-tune changes nearly every weight) shows in them, and hashing them costs milliseconds
# where hashing every byte of a 135M model would cost about a second per memory.
IDENTITY_SAMPLES = 4096


def model_identity(model: Any) -> dict[str, Any]:
    """What a stored fact's KV depends on: the architecture and every weight before and in the
    attention layers (a SHA-256 over each parameter's name, shape, dtype and
    ``IDENTITY_SAMPLES`` evenly spaced elements)."""
    config = model.config.get_text_config(decoder=True)
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        flat = parameter.detach().reshape(-1)
        step = max(1, flat.numel() // IDENTITY_SAMPLES)
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}".encode())
        sample = flat[::step].cpu().contiguous()
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        "dtype": str(next(model.parameters()).dtype),
        "rope": rope_description(config),
        "weights_sample_sha256": digest.hexdigest(),
    }


def rope_description(config: Any) -> str:
    """The text config's RoPE parameters, as a store records them."""
    return repr(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None))


class FactMemory:
    """Facts with their KV and embeddings; see the module docstring.

    ``embedder``: a callable from texts to vectors (default: all-MiniLM-L6-v2). ``path``: a
    directory; a store already there is reopened (checked against this model's identity, the
    embedder's name and dimension, ``context_turns`` and ``prefix``), and ``save()`` writes
    there. ``context_turns``: w, the turns each fact is encoded after. ``prefix``: text every
    fact is encoded after, before its turns (the prompts' header, say): no fact's page holds
    its K/V, which is kept once (``prefix_kv()``, saved with the facts); with it no fact token
    sits at position 0, where a model puts its attention sink. ``arena``: where the facts' K/V pages live (default: a private
    arena that grows and shrinks in segments); one page per fact, read by every prompt that
    retrieves it."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        embedder: Callable | None = None,
        path: str | os.PathLike | None = None,
        *,
        context_turns: int = 0,
        prefix: str = "",
        arena: KVArena | None = None,
    ) -> None:
        if (
            not isinstance(context_turns, int)
            or isinstance(context_turns, bool)
            or context_turns < 0
        ):
            raise InvalidArgumentError(f"context_turns={context_turns!r}; expected an int >= 0")
        layers = DynamicCache(config=model.config).layers
        for index, layer in enumerate(layers):
            if type(layer) is not DynamicLayer:
                raise KVStackError(
                    f"layer {index} is a {type(layer).__name__}; FactMemory injects K/V into "
                    "full attention layers only (no sliding windows or state layers)"
                )
        self.model, self.tokenizer = model, tokenizer
        self.rotary = _rotary(model)
        refusal = rope_refusal(model.config.get_text_config(decoder=True), self.rotary)
        if refusal is not None:
            raise KVStackError(f"FactMemory cannot serve {type(model).__name__}: {refusal}")
        self.identity = model_identity(model)
        self.context_turns = context_turns
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix={prefix!r}; expected a string")
        self.prefix = prefix
        self.prefix_ids = (
            list(tokenizer(prefix, add_special_tokens=False).input_ids) if prefix else []
        )
        self.max_positions = getattr(
            model.config.get_text_config(decoder=True), "max_position_embeddings", None
        )
        self.embedder = embedder if embedder is not None else MiniLMEmbedder()
        self.embedder_name = str(
            getattr(self.embedder, "name", None)
            or getattr(self.embedder, "__qualname__", None)  # a function's own name
            or type(self.embedder).__name__
        )
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        if arena is None:
            arena = KVArena.private(dtype=dtype, device=device)
        if arena.dtype != dtype or not _same_device(arena.device, device):
            raise InvalidArgumentError(
                f"arena holds {arena.dtype} on {arena.device}, but the model computes {dtype} on "
                f"{device}; give an arena of the model's dtype and device"
            )
        self.arena = arena
        self.facts: dict[str, Fact] = {}
        # A fact's K/V: one arena page, keys at position 0 then values, each [L, T, H_kv, D].
        self._pages: dict[str, Page] = {}
        self._vectors = torch.zeros(0, 0)  # [N, dim], rows in the order of self.facts
        # Computed on first use (prefix_kv), or read from a reopened store.
        self._prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stored: Any = None  # the reopened store's tensors (read lazily)
        # The serial of the store this memory opened or last saved (None: none yet). A save
        # names it, and is refused (StoreChanged) if another writer saved in between.
        self._serial: int | None = None
        self.path = None if path is None else storage.check_directory(path)
        if self.path is not None and storage.has_store(self.path):
            self._open()

    # ------------------------------------------------------------------ adding
    def __len__(self) -> int:
        return len(self.facts)

    def tokens(self, text: str) -> list[int]:
        """A fact's or turn's tokens in an assembled prompt: its text and a newline, alone."""
        return list(self.tokenizer(text + "\n", add_special_tokens=False).input_ids)

    def add(self, fact: str, context: Sequence[str] = ()) -> str:
        """Store ``fact`` encoded after the last ``context_turns`` of ``context`` (the turns
        before it, oldest first); returns its id."""
        return self.add_many([fact], [context])[0]

    @torch.no_grad()
    def add_many(
        self, facts: Sequence[str], contexts: Sequence[Sequence[str]] | None = None
    ) -> list[str]:
        """``add`` for several facts (one embedder call). All are checked and encoded before
        any is stored: on an error the memory is unchanged."""
        if isinstance(facts, str):
            raise InvalidArgumentError(
                f"facts={facts!r:.80}; expected a sequence of facts (use add() for one)"
            )
        contexts = [()] * len(facts) if contexts is None else list(contexts)
        if len(contexts) != len(facts):
            raise InvalidArgumentError(
                f"contexts has {len(contexts)} entries for {len(facts)} facts; expected one each"
            )
        encoded = []
        for fact, context in zip(facts, contexts, strict=True):
            if not isinstance(fact, str) or not fact.strip():
                raise InvalidArgumentError(f"fact={fact!r}; expected a non-empty string")
            if isinstance(context, str) or not all(isinstance(t, str) for t in context):
                raise InvalidArgumentError(
                    f"context={context!r:.80}; expected a sequence of turns (strings)"
                )
            encoded.append(self._encode(fact, list(context)))
        vectors = embed(self.embedder, list(facts))
        if len(self.facts) and vectors.shape[1] != self._vectors.shape[1]:
            raise InvalidArgumentError(
                f"embedder gives {vectors.shape[1]}-d vectors; this memory holds "
                f"{self._vectors.shape[1]}-d ones"
            )
        ids = [f"f{len(self.facts) + i}" for i in range(len(facts))]
        # Everything that can fail before anything changes: the vectors joined (on the CPU,
        # where a reopened store's are), then the pages (all or none).
        vectors = vectors.cpu()
        joined = vectors if not len(self._vectors) else torch.cat([self._vectors, vectors])
        self._store_pages({i: (k, v) for i, (_, _, k, v) in zip(ids, encoded, strict=True)})
        for fact_id, fact, (token_ids, context_tokens, _, _) in zip(
            ids, facts, encoded, strict=True
        ):
            self.facts[fact_id] = Fact(fact_id, fact, tuple(token_ids), context_tokens)
        self._vectors = joined
        return ids

    @torch.no_grad()
    def prefix_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix's own K/V (keys at position 0, as the facts'; [L, T, H_kv, D] each):
        saved with the facts, for a server whose prompts must start with cached tokens (vLLM's
        connector loads the prefix and the facts as one cached run)."""
        if self._prefix_kv is None:
            self._prefix_kv = self._kv_at_zero([], self.prefix_ids)
        return self._prefix_kv

    def _encode(self, fact: str, context: list[str]):
        """One forward pass over [the last w turns, the fact]; the fact's K/V, keys at 0."""
        fact_ids = self.tokens(fact)
        if self.max_positions is not None and len(fact_ids) > self.max_positions:
            raise InvalidArgumentError(
                f"fact has {len(fact_ids)} tokens, more than the model's context of "
                f"{self.max_positions}; split it"
            )
        turns = context[max(0, len(context) - self.context_turns) :] if self.context_turns else []
        context_ids = [t for turn in turns for t in self.tokens(turn)]
        if self.max_positions is not None:  # the oldest context goes first when it would not fit
            room = self.max_positions - len(fact_ids) - len(self.prefix_ids)
            context_ids = context_ids[max(0, len(context_ids) - max(0, room)) :]
            if room < 0:
                raise InvalidArgumentError(
                    f"prefix ({len(self.prefix_ids)} tokens) and fact ({len(fact_ids)}) exceed "
                    f"the model's context of {self.max_positions}"
                )
        context_ids = self.prefix_ids + context_ids
        keys, values = self._kv_at_zero(context_ids, fact_ids)
        return fact_ids, len(context_ids), keys, values

    def _kv_at_zero(self, context_ids: list[int], ids: list[int]):
        """One forward pass over ``context_ids + ids``; the K/V of ``ids`` alone, keys turned
        back to position 0: ([L, T, H_kv, D], [L, T, H_kv, D])."""
        device = next(self.model.parameters()).device
        cache = DynamicCache(config=self.model.config)
        self.model(
            torch.tensor([context_ids + ids], device=device), **{cache_keyword(self.model): cache}
        )
        start = len(context_ids)
        # Each layer's slice [1, H_kv, T, D] -> [T, H_kv, D], stacked over layers.
        keys = torch.stack([layer.keys[0, :, start:].transpose(0, 1) for layer in cache.layers])
        values = torch.stack([layer.values[0, :, start:].transpose(0, 1) for layer in cache.layers])
        positions = torch.arange(start, start + len(ids), device=device)
        return rotate_keys_by(keys, -positions, self.rotary).contiguous(), values.contiguous()

    # ------------------------------------------------------------------ retrieval
    def retrieve(self, query: str, k: int) -> list[str]:
        """The ids of the ``k`` facts closest to ``query`` by cosine of their embeddings."""
        if not self.facts:
            raise InvalidArgumentError("the memory holds no facts to retrieve from")
        indices = cosine_top_k(self._vectors, embed(self.embedder, [query])[0], k)
        order = list(self.facts)
        return [order[i] for i in indices.tolist()]

    # ------------------------------------------------------------------ injection
    def prompt_ids(self, header: str, fact_ids: Sequence[str], question: str) -> list[int]:
        """The assembled prompt's token ids: header, each fact's tokens, the question."""
        facts = self._facts(fact_ids)
        header_ids = (
            list(self.tokenizer(header, add_special_tokens=False).input_ids) if header else []
        )
        question_ids = list(self.tokenizer(question, add_special_tokens=False).input_ids)
        return header_ids + [t for f in facts for t in f.token_ids] + question_ids

    # ------------------------------------------------------------------ the arena
    def _store_pages(self, kv: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A page for each fact's K/V, filled; all or none (a full arena frees what it took)."""
        taken: dict[str, Page] = {}
        try:
            # Outside inference mode: a growing arena's new buffer must be a normal tensor,
            # which caches on the arena may write to later.
            with torch.inference_mode(False):
                for fact_id, (keys, _) in kv.items():
                    (taken[fact_id],) = self.arena.allocate(self, "kv", 2 * keys.numel())
            for fact_id, (keys, values) in kv.items():  # no allocation from here: offsets hold
                page = taken[fact_id]
                flat = self.arena.buffer[page.offset : page.end]  # [2 * L * T * H_kv * D]
                flat[: keys.numel()].copy_(keys.reshape(-1))
                flat[keys.numel() :].copy_(values.reshape(-1))
        except BaseException:
            self.arena.free(taken.values())
            raise
        self._pages.update(taken)

    def pages_moved(self, moves: dict[Page, int]) -> None:
        """The arena moved pages (compaction) or replaced its buffer: nothing to do, a fact's
        views are taken from its page's offset when they are used."""

    def release(self) -> None:
        """Return to the arena the pages of every fact the store on disk holds (the memory
        keeps its facts' text and embeddings, and reads their K/V back on use). Facts added
        since the last ``save()`` keep their pages: their K/V is nowhere else."""
        saved = self._saved_names()
        released = [f for f in self._pages if f"{f}.k" in saved]
        self.arena.free([self._pages.pop(f) for f in released])

    def _saved_names(self) -> set[str]:
        """The tensor names of the store this memory opened or last saved."""
        return set(self._stored.keys()) if self._stored is not None else set()

    def _check_kv_exists(self, fact_ids: Sequence[str]) -> None:
        """Every fact of ``fact_ids`` has its K/V in a page or in the saved store (what
        ``_resident`` reads back and ``save`` writes from)."""
        saved = self._saved_names()
        lost = [f for f in fact_ids if f not in self._pages and f"{f}.k" not in saved]
        if lost:
            raise KVStackError(f"facts {lost} have no K/V: neither a page nor the saved store")

    @property
    def bytes_held(self) -> int:
        """Bytes of the facts' K/V pages in the arena."""
        return sum(page.size for page in self._pages.values()) * self.arena.itemsize

    def _resident(self, fact_ids: Sequence[str]) -> None:
        """Every fact of ``fact_ids`` has its page, read from the reopened store if needed."""
        missing = [f for f in dict.fromkeys(fact_ids) if f not in self._pages]
        if not missing:  # the usual case: no need to list the store's tensors
            return
        self._check_kv_exists(missing)
        self._store_pages(
            {
                f: (self._stored.get_tensor(f"{f}.k"), self._stored.get_tensor(f"{f}.v"))
                for f in missing
            }
        )

    def kv(self, fact_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A fact's stored K/V: keys rotated to position 0 and values, each [L, T, H_kv, D];
        views of its arena page, valid until the arena next allocates or compacts."""
        fact = self._facts([fact_id])[0]
        self._resident([fact_id])
        return self._page_views(fact)

    def _page_views(self, fact: Fact) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv(fact.id)`` for a fact whose page is resident."""
        page = self._pages[fact.id]
        shape = (self.identity["layers"], len(fact.token_ids), self.identity["kv_heads"], -1)
        flat = self.arena.buffer[page.offset : page.end]
        half = page.size // 2
        return flat[:half].view(shape), flat[half:].view(shape)

    @torch.no_grad()
    def inject(self, cache: Any, fact_ids: Sequence[str], position: int | None = None) -> int:
        """Write the facts' K/V into ``cache``, one after another from ``position`` (default:
        the tokens the cache holds, which it must equal), keys rotated at those positions.
        Returns the position after the last fact."""
        facts = self._facts(fact_ids)
        held = cache.get_seq_length()
        position = held if position is None else position
        if position != held:
            raise InvalidArgumentError(
                f"position={position}, but the cache holds {held} tokens; facts go right after them"
            )
        if any(getattr(layer, "needs_kvstack_attention", False) for layer in cache.layers):
            raise KVStackError(
                f"injecting into an evicting cache ({type(cache).__name__}: its tables evict in "
                "the kvstack attention, which an injection does not run) is not supported yet; "
                "use DynamicCache or PagedCache"
            )
        if not facts:
            return position
        keys, values = self._kv_at(facts, position)  # [L, T, H_kv, D] each
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [L, H_kv, T, D]
        for layer in range(keys.shape[0]):
            cache.update(keys[layer][None].contiguous(), values[layer][None].contiguous(), layer)
        _forget_kvstack_step()
        return position + keys.shape[2]

    def _kv_at(
        self, facts: list[Fact], position: int, with_prefix: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K/V of (the prefix and) ``facts`` one after another, keys rotated at
        ``position`` onwards, on the model's device: [L, T, H_kv, D] each."""
        self._resident([f.id for f in facts])  # any read from the store first: views then hold
        parts = ([self.prefix_kv()] if with_prefix else []) + [self._page_views(f) for f in facts]
        device = next(self.model.parameters()).device
        keys = torch.cat([k.to(device) for k, _ in parts], dim=1)  # [L, T, H_kv, D], at 0
        values = torch.cat([v.to(device) for _, v in parts], dim=1)
        positions = torch.arange(position, position + keys.shape[1], device=device)
        return rotate_keys_by(keys, positions, self.rotary), values

    @torch.no_grad()
    def build_cache(
        self,
        header: str,
        fact_ids: Sequence[str],
        question: str,
        cache: Any = None,
        *,
        recompute_first: int = 0,
    ) -> tuple[Any, torch.Tensor]:
        """A cache holding the header (prefilled) and the facts (injected), and the assembled
        prompt's ids [1, n]: ``generate(input_ids, past_key_values=cache)`` then prefills only
        the question.

        ``recompute_first=r``: the first r tokens of every fact are then computed again in the
        prompt, attending to the header, the facts before them and each other, and their K/V
        replace the injected ones (EPIC's "LegoLink": a fact's first tokens are where K/V
        computed apart differ most from the same tokens prefilled in place). r at least every
        fact's length gives full prefill's K/V; 0 is plain injection. ``DynamicCache`` only, on
        a model running sdpa or eager attention (the recompute passes its own 4D mask)."""
        if not isinstance(recompute_first, int) or recompute_first < 0:
            raise InvalidArgumentError(
                f"recompute_first={recompute_first!r}; expected an int >= 0 (tokens per fact)"
            )
        if recompute_first and cache is not None and type(cache) is not DynamicCache:
            raise InvalidArgumentError(
                f"recompute_first needs a DynamicCache (its K/V are replaced in place); got "
                f"{type(cache).__name__}"
            )
        if (
            not isinstance(question, str)
            or not self.tokenizer(question, add_special_tokens=False).input_ids
        ):
            # generate() must compute at least the question's last token: with none, the
            # prompt would end inside the injected facts and nothing would give the first token.
            raise InvalidArgumentError(f"question={question!r}; expected text with tokens")
        if cache is not None and cache.get_seq_length():
            raise InvalidArgumentError(
                f"cache holds {cache.get_seq_length()} tokens; build_cache fills an empty cache "
                "(the prompt it returns starts at position 0)"
            )
        cache = DynamicCache(config=self.model.config) if cache is None else cache
        ids = self.prompt_ids(header, fact_ids, question)
        device = next(self.model.parameters()).device
        header_ids = (
            list(self.tokenizer(header, add_special_tokens=False).input_ids) if header else []
        )
        if header:
            self.model(
                torch.tensor([header_ids], device=device),
                use_cache=True,
                **{cache_keyword(self.model): cache},
            )
        at = cache.get_seq_length()  # where the facts go
        self.inject(cache, fact_ids)
        if recompute_first:
            positions = []
            for fact in self._facts(fact_ids):
                positions += range(at, at + min(recompute_first, len(fact.token_ids)))
                at += len(fact.token_ids)
            self._recompute(cache, ids, positions)
        return cache, torch.tensor([ids], device=device)

    def _recompute(self, cache: DynamicCache, ids: list[int], positions: list[int]) -> None:
        """Compute the tokens at ``positions`` (ascending, all held by ``cache``) again in one
        forward pass, each attending to every other held token before it and to the
        recomputed ones up to itself, and write their K/V over the old ones."""
        if not positions:
            return
        device = next(self.model.parameters()).device
        held = cache.get_seq_length()
        chosen = torch.tensor(positions, device=device)  # [S]
        old = torch.arange(held, device=device)  # [held]
        # [S, held + S]: old entries before each token, except those being replaced; the new
        # entries (appended after the held ones) up to and including its own.
        sees_old = (old[None, :] < chosen[:, None]) & ~torch.isin(old, chosen)[None, :]
        sees_new = chosen[None, :] <= chosen[:, None]
        visible = torch.cat([sees_old, sees_new], dim=1)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)  # additive: sdpa and eager alike
        self.model(
            torch.tensor([[ids[p] for p in positions]], device=device),
            position_ids=chosen[None],
            attention_mask=mask[None, None],  # [1, 1, S, held + S]
            use_cache=True,
            **{cache_keyword(self.model): cache},
        )
        for layer in cache.layers:  # [1, H_kv, held + S, D]: the new entries over the old
            keys, values = layer.keys.clone(), layer.values.clone()
            keys[:, :, chosen], values[:, :, chosen] = keys[:, :, held:], values[:, :, held:]
            layer.keys, layer.values = keys[:, :, :held], values[:, :, :held]

    @torch.no_grad()
    def prompt_kv(
        self, fact_ids: Sequence[str], question: str
    ) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor]]:
        """For a server that takes a prompt's first K/V ready (``kvstack.serve.Engine``'s
        ``submit(ids, n, prefix_kv=kv)``): the prompt's ids, ``prompt_ids(self.prefix, fact_ids,
        question)``, and the K/V of its prefix and facts, keys rotated at their positions 0..n-1
        ([L, n, H_kv, D] each, n = prefix and fact tokens; the memory's prefix stands for the
        header, as in vLLM's connector). Only the question is left to compute."""
        facts = self._facts(fact_ids)
        ids = self.prompt_ids(self.prefix, fact_ids, question)
        if len(ids) == len(self.prefix_ids) + sum(len(f.token_ids) for f in facts):
            raise InvalidArgumentError(f"question={question!r} has no tokens; a prompt needs one")
        if not self.prefix_ids and not facts:
            raise InvalidArgumentError("no prefix and no facts: there is no K/V to give")
        keys, values = self._kv_at(facts, 0, with_prefix=bool(self.prefix_ids))
        return ids, (keys.contiguous(), values)

    def _facts(self, fact_ids: Sequence[str]) -> list[Fact]:
        if isinstance(fact_ids, str):
            raise InvalidArgumentError(f"fact_ids={fact_ids!r}; expected a sequence of ids")
        missing = [f for f in fact_ids if f not in self.facts]
        if missing:
            raise InvalidArgumentError(f"fact ids {missing} are not in this memory")
        return [self.facts[f] for f in fact_ids]

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        """Write every fact (text, tokens, K/V, embedding) to ``path``, atomically. Raises
        ``StoreChanged`` (and writes nothing) when another writer saved to ``path`` since this
        memory opened or last saved it: writing on would drop that save's facts."""
        if self.path is None:
            raise InvalidArgumentError("this memory has no path; build it with path=")
        self._check_kv_exists(list(self.facts))
        tensors = {"vectors": self._vectors}
        if self.prefix_ids:
            tensors["prefix.k"], tensors["prefix.v"] = self.prefix_kv()
        for fact_id, fact in self.facts.items():
            # A released fact is written from the store it was read from, not brought back into
            # the arena first: saving a memory takes none of the arena's pages.
            tensors[f"{fact_id}.k"], tensors[f"{fact_id}.v"] = (
                self._page_views(fact)
                if fact_id in self._pages
                else (
                    self._stored.get_tensor(f"{fact_id}.k"),
                    self._stored.get_tensor(f"{fact_id}.v"),
                )
            )
        index = {
            "model": self.identity,
            "embedder": {"name": self.embedder_name, "dim": int(self._vectors.shape[1])},
            "context_turns": self.context_turns,
            "prefix": self.prefix,
            "prefix_ids": self.prefix_ids,
            "facts": [
                {
                    "id": f.id,
                    "text": f.text,
                    "token_ids": list(f.token_ids),
                    "context_tokens": f.context_tokens,
                }
                for f in self.facts.values()
            ],
        }
        record, self._stored = storage.write_store(
            self.path, index, tensors, expected_serial=self._serial
        )
        self._serial = record["serial"]

    def _open(self) -> None:
        index, stored = storage.open_store(self.path)
        if index["model"] != self.identity:
            raise InvalidArgumentError(
                f"the fact store in {str(self.path)!r} was built for another model: "
                f"{index['model']}; this model is {self.identity}"
            )
        if index.get("prefix", "") != self.prefix:
            raise InvalidArgumentError(
                f"the fact store in {str(self.path)!r} encoded its facts after the prefix "
                f"{index.get('prefix', '')!r}; this memory's prefix is {self.prefix!r}"
            )
        if list(index.get("prefix_ids", [])) != self.prefix_ids:
            raise InvalidArgumentError(
                f"the fact store in {str(self.path)!r} tokenized its prefix as "
                f"{index.get('prefix_ids')}; this tokenizer gives {self.prefix_ids}"
            )
        if index.get("context_turns") != self.context_turns:
            raise InvalidArgumentError(
                f"the fact store in {str(self.path)!r} encoded each fact after "
                f"context_turns={index.get('context_turns')!r}; this memory has "
                f"context_turns={self.context_turns}"
            )
        vectors = stored.get_tensor("vectors")
        probe = embed(self.embedder, ["probe"])
        if len(vectors) and probe.shape[1] != index["embedder"]["dim"]:
            raise InvalidArgumentError(
                f"the fact store in {str(self.path)!r} holds {index['embedder']['dim']}-d "
                f"embeddings ({index['embedder']['name']}); this embedder gives {probe.shape[1]}-d"
            )
        saved_embedder = index["embedder"]["name"]
        # (Stores saved before functions were named record every function as "function".)
        if index["facts"] and saved_embedder not in (self.embedder_name, "function"):
            raise InvalidArgumentError(
                f"the fact store in {str(self.path)!r} was embedded by "
                f"{saved_embedder!r}; this memory's embedder is {self.embedder_name!r}"
            )
        names = set(stored.keys())
        lacking = [f["id"] for f in index["facts"] if {f"{f['id']}.k", f"{f['id']}.v"} - names]
        if lacking:
            raise StoreCorrupted(
                f"the fact store in {str(self.path)!r} names facts {lacking[:5]} whose K/V its "
                f"tensors file {index['tensors']!r} lacks"
            )
        self.facts = {
            f["id"]: Fact(f["id"], f["text"], tuple(f["token_ids"]), f["context_tokens"])
            for f in index["facts"]
        }
        self._vectors, self._stored, self._serial = vectors, stored, index["serial"]
        if "prefix.k" in stored.keys():
            self._prefix_kv = (stored.get_tensor("prefix.k"), stored.get_tensor("prefix.v"))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one: ``cuda`` names the current CUDA device, ``cuda:0`` its
    index."""

    def index(device: torch.device) -> int | None:
        if device.index is None and device.type == "cuda":
            return torch.cuda.current_device()
        return device.index

    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and index(a) == index(b)


def _forget_kvstack_step() -> None:
    """A kvstack cache's ``update`` announces its layer to the attention call that follows;
    an injection has none, so the announcement is withdrawn."""
    import sys

    attention = sys.modules.get("kvstack.hf.attention")
    if attention is not None:
        attention.STEP.layer, attention.STEP.key = None, None


__all__ = ["Fact", "FactMemory", "model_identity", "rope_refusal", "rotate_keys_by"]
