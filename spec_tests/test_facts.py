"""FactMemory (InferScale): chunked-RoPE injection is exact for every rope type, injecting every
fact in order with its whole context reproduces full prefill, retrieval is cosine top-k, the
store survives a restart and refuses what it was not built for, and bad input changes nothing."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaForCausalLM

from kvstack import ops
from kvstack.errors import InvalidArgumentError, KVStackError, StoreCorrupted
from kvstack.facts import FactMemory, cosine_top_k
from kvstack.facts import storage as storage_module
from kvstack.reference.rope import rotate_keys
from spec_tests.strategies import ROPE_PARAMETERS
from spec_tests.tiny import TINY_LLAMA, tiny_llama_config


class ByteTokenizer:
    """One token per byte: the tokens of a concatenation are the concatenation of the tokens."""

    class Encoding:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=False):
        return self.Encoding([b % 255 + 1 for b in text.encode()])


def word_embedder(texts):
    """A bag of hashed words, 32-d: texts sharing words are close by cosine."""
    rows = torch.zeros(len(texts), 32)
    for row, text in enumerate(texts):
        for word in text.lower().replace(".", " ").replace("?", " ").split():
            rows[row, int(hashlib.sha256(word.encode()).hexdigest(), 16) % 32] += 1.0
    return rows


FACTS = [
    "Alice's dog is named Biscuit.",
    "Biscuit likes red balls.",
    "Bob is a baker in Lisbon.",
    "Carol plays the cello.",
]

_MODELS: dict[tuple[str, int], LlamaForCausalLM] = {}


def tiny_model(rope: str = "default", seed: int = 0) -> LlamaForCausalLM:
    if (rope, seed) not in _MODELS:
        torch.manual_seed(seed)
        config = tiny_llama_config(
            rope_parameters=dict(ROPE_PARAMETERS[rope]), max_position_embeddings=512
        )
        model = LlamaForCausalLM(config).eval()
        model.generation_config.pad_token_id = 0
        _MODELS[rope, seed] = model
    return _MODELS[rope, seed]


def memory(model=None, **kwargs) -> FactMemory:
    kwargs.setdefault("embedder", word_embedder)
    return FactMemory(model or tiny_model(), ByteTokenizer(), **kwargs)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


# --------------------------------------------------------------------------- chunked RoPE
@settings(deadline=None, max_examples=8)
@given(
    rope=st.sampled_from(sorted(ROPE_PARAMETERS)),
    context=st.integers(0, 3),
    position=st.integers(0, 300),
)
def test_injected_keys_equal_the_pre_rope_keys_rotated_at_their_new_positions(
    rope, context, position
):
    model = tiny_model(rope)
    captured = []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, out: captured.append(out))
        for layer in model.model.layers
    ]
    try:
        mem = memory(model, context_turns=context)
        fact_id = mem.add(FACTS[1], context=FACTS[:context] + ["Dave sings."])
    finally:
        for hook in hooks:
            hook.remove()
    fact = mem.facts[fact_id]
    count, heads, head_dim = len(fact.token_ids), 2, 16
    cache = DynamicCache(config=model.config)
    for layer in range(2):  # ``position`` tokens already in the cache
        filler = torch.zeros(1, heads, position, head_dim)
        cache.update(filler, filler, layer)
    assert mem.inject(cache, [fact_id]) == position + count
    positions = torch.arange(position, position + count)
    for layer in range(2):
        # k_proj's output for the fact's tokens, [1, n, H_kv * D] -> [T, H_kv, D]: pre-RoPE.
        pre_rope = captured[layer][0, -count:].reshape(count, heads, head_dim)
        expected = rotate_keys(pre_rope, positions, model.model.rotary_emb)  # as the model does
        got = cache.layers[layer].keys[0, :, position:].transpose(0, 1)  # [T, H_kv, D]
        assert relative_error(got, expected) <= 1e-5, rope


@pytest.mark.parametrize("cache_kind", ["dynamic", "paged"])
def test_every_fact_in_order_with_its_whole_context_reproduces_full_prefill(cache_kind):
    from kvstack.hf import PagedCache

    model = tiny_model()
    mem = memory(context_turns=len(FACTS) + 1)
    # The whole context before a fact: the header (a turn "Notes:" is "Notes:\n") and the facts.
    header, question = "Notes:\n", "Who bakes? "
    ids = [mem.add(fact, context=["Notes:", *FACTS[:i]]) for i, fact in enumerate(FACTS)]
    prompt = torch.tensor([mem.prompt_ids(header, ids, question)])
    cache = PagedCache(model.config) if cache_kind == "paged" else None
    cache, input_ids = mem.build_cache(header, ids, question, cache=cache)
    assert torch.equal(input_ids, prompt)
    assert cache.get_seq_length() == prompt.shape[1] - len(question)
    with torch.inference_mode():
        full = model(prompt).logits[0, -len(question) :]
        injected = model(
            prompt[:, cache.get_seq_length() :], past_key_values=cache, use_cache=True
        ).logits[0]
    assert relative_error(injected, full) <= 1e-5
    # And generate from the injected cache makes full prefill's tokens.
    cache, input_ids = mem.build_cache(header, ids, question)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
        got = model.generate(input_ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)


def test_recomputing_every_fact_token_in_place_reproduces_full_prefill():
    """Facts encoded alone (w = 0, far from their place in the prompt); recompute_first at
    least every fact's length computes them again in the prompt: full prefill's logits. A few
    tokens per fact move the question's logits towards it."""
    model = tiny_model()
    mem = memory()
    ids = mem.add_many(FACTS)
    header, question = "Notes:\n", "Who bakes? "
    prompt = torch.tensor([mem.prompt_ids(header, ids, question)])
    with torch.inference_mode():
        full = model(prompt).logits[0, -len(question) :]

    def question_logits(recompute_first):
        cache, _ = mem.build_cache(header, ids, question, recompute_first=recompute_first)
        assert cache.get_seq_length() == prompt.shape[1] - len(question)
        with torch.inference_mode():
            return model(
                prompt[:, cache.get_seq_length() :], past_key_values=cache, use_cache=True
            ).logits[0]

    longest = max(len(mem.facts[f].token_ids) for f in ids)
    assert relative_error(question_logits(longest), full) <= 1e-5
    assert relative_error(question_logits(10 * longest), full) <= 1e-5
    plain, some = relative_error(question_logits(0), full), relative_error(question_logits(4), full)
    assert plain > 1e-3 and some < plain


def test_recompute_first_refuses_bad_counts_and_caches_it_cannot_edit():
    from kvstack.hf import PagedCache

    mem = memory()
    mem.add(FACTS[0])
    for bad in (-1, 1.5, "2"):
        with pytest.raises(InvalidArgumentError, match="recompute_first=.*expected an int >= 0"):
            mem.build_cache("Notes:\n", ["f0"], "Who? ", recompute_first=bad)
    cache = PagedCache(tiny_model().config)
    with pytest.raises(InvalidArgumentError, match="recompute_first needs a DynamicCache"):
        mem.build_cache("Notes:\n", ["f0"], "Who? ", cache=cache, recompute_first=2)
    assert cache.get_seq_length() == 0


def test_build_cache_refuses_a_question_without_tokens_and_leaves_the_cache_empty():
    mem = memory()
    mem.add(FACTS[0])
    cache = DynamicCache(config=tiny_model().config)
    for bad in ("", None):
        with pytest.raises(InvalidArgumentError, match="question=.*expected text with tokens"):
            mem.build_cache("Notes:\n", ["f0"], bad, cache=cache)
    assert cache.get_seq_length() == 0


def test_build_cache_refuses_a_cache_that_already_holds_tokens_and_leaves_it_unchanged():
    mem = memory()
    mem.add(FACTS[0])
    cache, _ = mem.build_cache("Notes:\n", ["f0"], "Who? ")
    held = cache.get_seq_length()
    keys = cache.layers[0].keys.clone()
    with pytest.raises(InvalidArgumentError, match=f"cache holds {held} tokens"):
        mem.build_cache("Notes:\n", ["f0"], "Who? ", cache=cache)
    assert cache.get_seq_length() == held and torch.equal(cache.layers[0].keys, keys)


def test_a_fact_keeps_only_its_own_kv_and_w_bounds_the_context_it_was_encoded_after():
    mem = memory(context_turns=2)
    fact_id = mem.add(FACTS[3], context=FACTS[:3])
    fact = mem.facts[fact_id]
    keys, values = mem.kv(fact_id)
    assert keys.shape == values.shape == (2, len(fact.token_ids), 2, 16)  # [L, T, H_kv, D]
    assert fact.context_tokens == sum(len(mem.tokens(turn)) for turn in FACTS[1:3])
    alone = memory()  # w = 0: the fact alone, whatever context is given
    assert alone.facts[alone.add(FACTS[3], context=FACTS[:3])].context_tokens == 0
    wide = memory(context_turns=10)  # w beyond the turns there are: all of them
    everything = sum(len(wide.tokens(turn)) for turn in FACTS[:3])
    assert wide.facts[wide.add(FACTS[3], context=FACTS[:3])].context_tokens == everything


# --------------------------------------------------------------------------- retrieval
def test_retrieval_is_cosine_top_k_best_first():
    mem = memory()
    ids = mem.add_many(FACTS)
    assert mem.retrieve("what is the name of alice's dog biscuit", 1) == [ids[0]]
    assert mem.retrieve("biscuit likes red balls", 2)[0] == ids[1]
    vectors = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [-1.0, 0.0]])
    assert cosine_top_k(vectors, torch.tensor([3.0, 1.0]), 3).tolist() == [0, 1, 2]
    for k in (0, 5, 2.0, True):
        with pytest.raises(InvalidArgumentError, match=r"k=.*expected an int in \[1, 4\]"):
            mem.retrieve("dog", k)


def test_the_default_embedder_is_all_minilm_l6_v2_and_ranks_by_meaning():
    from kvstack.facts import MiniLMEmbedder

    embedder = MiniLMEmbedder()
    vectors = embedder(["A puppy is playing.", "A dog plays.", "Stock markets fell today."])
    assert vectors.shape == (3, 384)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(3))
    assert cosine_top_k(vectors[1:], vectors[0], 1).tolist() == [0]


# --------------------------------------------------------------------------- persistence
def test_a_saved_memory_reopens_in_a_new_object_with_the_same_kv(tmp_path):
    mem = memory(path=tmp_path, context_turns=1)
    ids = [mem.add(fact, context=FACTS[:i]) for i, fact in enumerate(FACTS)]
    mem.save()
    again = memory(path=tmp_path, context_turns=1)
    assert list(again.facts.values()) == list(mem.facts.values())
    for fact_id in ids:
        for a, b in zip(again.kv(fact_id), mem.kv(fact_id), strict=True):
            assert torch.equal(a, b)
    assert again.retrieve("alice dog biscuit", 1) == [ids[0]]
    # A second save replaces the first: one tensors file, the index names it.
    again.add("Erin drives a blue van.")
    again.save()
    assert len(list(tmp_path.glob("facts.*.safetensors"))) == 1
    assert len(memory(path=tmp_path, context_turns=1)) == len(FACTS) + 1


def test_a_save_killed_before_its_index_leaves_the_last_good_store(tmp_path, monkeypatch):
    mem = memory(path=tmp_path)
    mem.add_many(FACTS[:2])
    mem.save()
    mem.add(FACTS[2])
    real_replace = os.replace

    def killed(src, dst):
        if str(dst).endswith("index.json"):
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(storage_module.os, "replace", killed)
    with pytest.raises(OSError, match="killed"):
        mem.save()
    monkeypatch.undo()
    assert len(memory(path=tmp_path)) == 2  # the index still names the first save's file, whole


@pytest.mark.parametrize("damage", ["flip", "truncate", "index", "edit"])
def test_a_damaged_store_raises_store_corrupted_naming_the_file(tmp_path, damage):
    mem = memory(path=tmp_path)
    mem.add_many(FACTS)
    mem.save()
    (tensors,) = tmp_path.glob("facts.*.safetensors")
    if damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:100])
    elif damage == "index":
        (tmp_path / "index.json").write_text('{"version": 1, "facts": [')
    else:  # valid JSON with every field, one fact's text changed: only the checksum tells
        import json

        index = json.loads((tmp_path / "index.json").read_text())
        index["facts"][0]["text"] = "The cat is grey."
        (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreCorrupted, match="facts.0.safetensors|index.json"):
        memory(path=tmp_path)


def test_a_version_1_store_without_an_index_checksum_still_opens(tmp_path):
    import json

    mem = memory(path=tmp_path)
    ids = mem.add_many(FACTS)
    mem.save()
    index = json.loads((tmp_path / "index.json").read_text())
    del index["index_sha256"]
    (tmp_path / "index.json").write_text(json.dumps(dict(index, version=1)))
    reopened = memory(path=tmp_path)
    assert [reopened.facts[f].text for f in ids] == FACTS
    index["version"] = 2  # a version 2 index must carry its checksum
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreCorrupted, match="fails its SHA-256 check"):
        memory(path=tmp_path)


def test_a_store_of_another_model_or_embedder_is_refused(tmp_path):
    mem = memory(path=tmp_path)
    mem.add_many(FACTS)
    mem.save()
    with pytest.raises(InvalidArgumentError, match="built for another model"):
        memory(tiny_model(seed=1), path=tmp_path)
    with pytest.raises(InvalidArgumentError, match="holds 32-d embeddings"):
        memory(path=tmp_path, embedder=lambda texts: torch.ones(len(texts), 8))
    with pytest.raises(InvalidArgumentError, match="was embedded by 'word_embedder'"):
        memory(path=tmp_path, embedder=lambda texts: word_embedder(texts))
    with pytest.raises(InvalidArgumentError, match="context_turns=0; this memory has"):
        memory(path=tmp_path, context_turns=2)


def test_a_store_is_refused_by_a_model_that_differs_only_outside_its_kv_projections(tmp_path):
    import copy

    mem = memory(path=tmp_path)
    mem.add_many(FACTS)
    mem.save()
    tuned = copy.deepcopy(tiny_model())  # the same K/V projections, another MLP in layer 0:
    with torch.no_grad():  # every later layer's K/V changes
        tuned.model.layers[0].mlp.down_proj.weight.add_(0.01)
    with pytest.raises(InvalidArgumentError, match="built for another model"):
        memory(tuned, path=tmp_path)
    assert len(memory(path=tmp_path)) == len(FACTS)  # the model it was built with reopens it


def test_a_store_whose_index_names_a_fact_without_kv_raises_store_corrupted(tmp_path):
    import json

    mem = memory(path=tmp_path)
    mem.add_many(FACTS)
    mem.save()
    index = json.loads((tmp_path / "index.json").read_text())
    index["facts"].append(dict(index["facts"][0], id="f99"))
    index["index_sha256"] = storage_module._record_sha256(index)  # the index itself checks out
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreCorrupted, match=r"names facts \['f99'\] whose K/V"):
        memory(path=tmp_path)


# --------------------------------------------------------------------------- bad input
def test_bad_input_raises_and_changes_nothing():
    mem = memory()
    mem.add(FACTS[0])
    before = (dict(mem.facts), mem._vectors.clone())
    with pytest.raises(InvalidArgumentError, match="more than the model's context of 512"):
        mem.add("x" * 600)
    with pytest.raises(InvalidArgumentError, match="expected a non-empty string"):
        mem.add_many([FACTS[1], "  "])  # the first is not stored either
    with pytest.raises(InvalidArgumentError, match="expected a sequence of turns"):
        mem.add(FACTS[1], context="one turn, not a list")
    with pytest.raises(InvalidArgumentError, match="facts='Biscuit'; expected a sequence"):
        mem.add_many("Biscuit")  # not seven one-letter facts
    with pytest.raises(InvalidArgumentError, match="embedder gives 8-d vectors"):
        mem.embedder = lambda texts: torch.ones(len(texts), 8)
        mem.add(FACTS[1])
    mem.embedder = word_embedder
    assert (dict(mem.facts), len(mem._vectors)) == (before[0], len(before[1]))
    with pytest.raises(InvalidArgumentError, match=r"fact ids \['f9'\] are not in this memory"):
        mem.inject(DynamicCache(config=tiny_model().config), ["f9"])
    cache = DynamicCache(config=tiny_model().config)
    with pytest.raises(InvalidArgumentError, match="position=3, but the cache holds 0 tokens"):
        mem.inject(cache, ["f0"], position=3)
    assert cache.get_seq_length() == 0
    with pytest.raises(InvalidArgumentError, match="context_turns=-1"):
        memory(context_turns=-1)


def test_a_model_with_sliding_window_layers_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**TINY_LLAMA, sliding_window=8)
    with pytest.raises(KVStackError, match="full attention layers only"):
        FactMemory(MistralForCausalLM(config), ByteTokenizer(), embedder=word_embedder)


# --------------------------------------------------------------------------- the arena
class _Spacer:
    """An arena owner whose page sits below the facts' until it is freed."""

    def pages_moved(self, moves):
        pass


def test_fact_pages_live_in_the_arena_and_requests_on_it_share_its_budget(tmp_path):
    from kvstack.arena import KVArena
    from kvstack.hf import PagedCache

    arena = KVArena("4MiB")
    spacer = arena.allocate(_Spacer(), "kv", 4096)  # freed below: compaction moves the facts
    mem = memory(arena=arena, path=tmp_path)
    ids = mem.add_many(FACTS)
    arena.free(spacer)
    tokens = sum(len(mem.facts[f].token_ids) for f in ids)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16 dims, fp32
    assert mem.bytes_held == tokens * per_token == arena.bytes_used
    before = {f: [t.clone() for t in mem.kv(f)] for f in ids}
    # Two requests retrieve the same facts: each injects into its own cache on the same arena,
    # reading the one stored copy.
    caches = [PagedCache(tiny_model().config, arena=arena) for _ in range(2)]
    for cache in caches:
        mem.build_cache("Notes:\n", ids[:2], "Who? ", cache=cache)
    assert mem.bytes_held == tokens * per_token < arena.bytes_used
    for cache in caches:
        cache.release()
    assert arena.bytes_used == mem.bytes_held
    offsets = {f: mem._pages[f].offset for f in ids}
    arena.compact()  # the fact pages move down; the facts read the same
    assert all(mem._pages[f].offset < offsets[f] for f in ids)
    for f in ids:
        assert all(torch.equal(a, b) for a, b in zip(mem.kv(f), before[f], strict=True))
    mem.save()
    mem.release()  # every fact is in the store now
    assert arena.bytes_used == 0


def test_a_full_arena_raises_and_the_memory_is_unchanged():
    from kvstack.arena import KVArena
    from kvstack.errors import ArenaExhausted

    arena = KVArena(40_000)  # 78 tokens of fact K/V at 512 bytes a token: one fact, not four
    mem = memory(arena=arena)
    mem.add(FACTS[1])
    used = arena.bytes_used
    with pytest.raises(ArenaExhausted):
        mem.add_many(FACTS)  # the first pages fit, the rest do not: none is kept
    assert len(mem) == 1 and arena.bytes_used == used == mem.bytes_held
    with pytest.raises(InvalidArgumentError, match="arena holds torch.float16"):
        memory(arena=KVArena("1MiB", dtype=torch.float16))


def test_a_saved_memory_releases_its_pages_and_reads_them_back_on_use(tmp_path):
    mem = memory(path=tmp_path)
    ids = mem.add_many(FACTS)
    mem.save()
    before = [t.clone() for t in mem.kv(ids[2])]
    mem.release()
    assert mem.bytes_held == 0
    assert all(torch.equal(a, b) for a, b in zip(mem.kv(ids[2]), before, strict=True))
    assert mem.bytes_held == 2 * before[0].numel() * 4  # only that fact came back
    # A fact added since the save has its K/V only in its page: release keeps it.
    (late,) = mem.add_many(["Zoe rides a red bike."])
    late_kv = [t.clone() for t in mem.kv(late)]
    mem.release()
    assert mem.bytes_held == 2 * late_kv[0].numel() * 4
    assert all(torch.equal(a, b) for a, b in zip(mem.kv(late), late_kv, strict=True))
    mem.save()  # and it can be saved
    mem.release()
    assert mem.bytes_held == 0
    # Saving again writes the released facts from the store, without taking arena pages.
    allocate = mem.arena.allocate
    mem.arena.allocate = lambda *a, **k: pytest.fail("save() allocated an arena page")
    try:
        mem.save()
    finally:
        mem.arena.allocate = allocate
    reopened = FactMemory(mem.model, mem.tokenizer, embedder=word_embedder, path=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(reopened.kv(late), late_kv, strict=True)) and all(
        torch.equal(a, b) for a, b in zip(reopened.kv(ids[2]), before, strict=True)
    )
    unsaved = memory()
    unsaved.add(FACTS[0])
    held = unsaved.bytes_held
    unsaved.release()  # nothing saved: nothing released
    assert unsaved.bytes_held == held > 0


def test_the_prefix_kv_is_the_headers_own_and_is_saved_with_the_facts(tmp_path):
    model = tiny_model()
    header = "Notes:\n"
    mem = memory(path=tmp_path, prefix=header)
    mem.add(FACTS[0])
    keys, values = mem.prefix_kv()  # [L, T, H_kv, D], keys at position 0
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([mem.prefix_ids]), past_key_values=cache)
    count = len(mem.prefix_ids)
    for layer in range(2):
        direct = cache.layers[layer].keys[0].transpose(0, 1)  # [T, H_kv, D] at 0 .. T - 1
        rotated = ops.get("rerotate_keys")(keys[layer], torch.arange(count), model.model.rotary_emb)
        assert relative_error(rotated, direct) <= 1e-5
        assert torch.equal(values[layer], cache.layers[layer].values[0].transpose(0, 1))
    mem.save()
    again = memory(path=tmp_path, prefix=header)
    assert all(torch.equal(a, b) for a, b in zip(again.prefix_kv(), (keys, values), strict=True))
    with pytest.raises(InvalidArgumentError, match="encoded its facts after the prefix"):
        memory(path=tmp_path, prefix="Other:\n")


def test_injection_into_an_evicting_cache_is_refused_and_leaves_it_empty():
    from kvstack.hf import TokenTableCache
    from kvstack.policies import H2O

    mem = memory()
    mem.add(FACTS[0])
    cache = TokenTableCache(tiny_model().config, policy=H2O(), budget=32)
    with pytest.raises(
        KVStackError, match=r"evicting cache \(TokenTableCache: .* not supported yet"
    ):
        mem.inject(cache, ["f0"])
    assert cache.get_seq_length() == 0


def seeded_embedder(texts):
    """A random 64-d vector per distinct text (seeded by its hash): a text's nearest vector
    among thousands is its own."""
    rows = []
    for text in texts:
        seed = int(hashlib.sha256(text.encode()).hexdigest(), 16) % 2**31
        rows.append(torch.randn(64, generator=torch.Generator().manual_seed(seed)))
    return torch.stack(rows)


def test_a_store_of_thousands_of_facts_saves_reopens_retrieves_and_injects(tmp_path):
    facts = [f"Guest {i} sits at table {i % 97}." for i in range(2000)]
    mem = memory(embedder=seeded_embedder, path=tmp_path, prefix="Notes:\n")
    ids = mem.add_many(facts)
    assert len(mem) == 2000 and len(set(ids)) == 2000
    page_bytes = [2 * k.numel() * k.element_size() for k, _ in (mem.kv(i) for i in ids)]
    assert mem.bytes_held == sum(page_bytes)  # one arena page per fact, nothing more
    mem.save()
    again = memory(embedder=seeded_embedder, path=tmp_path, prefix="Notes:\n")
    assert len(again) == 2000
    for index in (0, 977, 1999):
        assert again.retrieve(facts[index], k=1) == [ids[index]]
        assert torch.equal(again.kv(ids[index])[0], mem.kv(ids[index])[0])
    chosen = again.retrieve(facts[1234], k=3)
    prompt, (keys, _) = again.prompt_kv(chosen, "Where? ")
    assert prompt == again.prompt_ids("Notes:\n", chosen, "Where? ")
    assert keys.shape[1] == len(again.prefix_ids) + sum(
        len(again.facts[f].token_ids) for f in chosen
    )


# --------------------------------------------------------------------------- writers and serials
def store_files(path) -> dict[str, bytes]:
    """Every file of a store directory and its bytes (the lock file is empty)."""
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_a_save_over_another_writers_save_raises_store_changed_and_writes_nothing(tmp_path):
    from kvstack.facts import StoreChanged

    first, second = memory(path=tmp_path), memory(path=tmp_path)  # both find no store
    first.add(FACTS[0])
    first.save()
    assert first._serial == 0
    second.add(FACTS[1])
    before = store_files(tmp_path)
    with pytest.raises(StoreChanged, match="at serial 0 .*expected serial None"):
        second.save()  # would drop first's fact
    assert store_files(tmp_path) == before and second._serial is None
    # A memory that opened the store at serial 0 is refused once first saves serial 1.
    third = memory(path=tmp_path)
    assert third._serial == 0
    first.add(FACTS[2])
    first.save()
    third.add(FACTS[3])
    before = store_files(tmp_path)
    with pytest.raises(StoreChanged, match="at serial 1 .*expected serial 0"):
        third.save()
    assert store_files(tmp_path) == before
    reopened = memory(path=tmp_path)  # first's two saves, and the serials count up
    assert [f.text for f in reopened.facts.values()] == [FACTS[0], FACTS[2]]
    assert reopened._serial == first._serial == 1
    reopened.add(FACTS[3])
    reopened.save()
    assert storage_module.read_index(tmp_path)["serial"] == reopened._serial == 2


def test_a_save_waits_for_the_writer_lock_on_the_store(tmp_path):
    import fcntl
    import threading

    mem = memory(path=tmp_path)
    mem.add(FACTS[0])
    with open(tmp_path / storage_module.LOCK, "a") as lock:  # another writer, mid-save
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        saving = threading.Thread(target=mem.save)
        saving.start()
        saving.join(timeout=0.5)
        assert saving.is_alive() and not storage_module.has_store(tmp_path)
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    saving.join(timeout=30)
    assert not saving.is_alive() and storage_module.read_index(tmp_path)["serial"] == 0


def test_a_reader_of_a_replaced_save_gets_store_changed_and_open_tensors_outlive_it(tmp_path):
    from kvstack.facts import StoreChanged

    mem = memory(path=tmp_path)
    mem.add(FACTS[0])
    mem.save()
    old_index = storage_module.read_index(tmp_path)
    opened = storage_module.open_tensors(tmp_path, old_index)
    keys = opened.get_tensor("f0.k").clone()
    mem.add(FACTS[1])
    mem.save()  # serial 1; facts.0.safetensors is removed after the new index is in place
    assert not (tmp_path / old_index["tensors"]).exists()
    assert torch.equal(opened.get_tensor("f0.k"), keys)  # opened before: still readable
    with pytest.raises(StoreChanged, match=r"facts.0.safetensors \(serial 0\) was replaced"):
        storage_module.open_tensors(tmp_path, old_index)
    index, _ = storage_module.open_store(tmp_path)
    assert index["serial"] == 1


def test_write_store_refuses_a_bad_expected_serial_and_writes_nothing(tmp_path):
    for bad in (-1, True, "0", 1.0):
        with pytest.raises(InvalidArgumentError, match=r"expected_serial=.*expected None"):
            storage_module.write_store(tmp_path, {}, {}, expected_serial=bad)
    assert list(tmp_path.iterdir()) == []


def test_save_and_kv_refuse_a_fact_without_kv_alike_and_save_writes_nothing(tmp_path):
    mem = memory(path=tmp_path)
    mem.add(FACTS[0])
    mem.save()
    mem.add(FACTS[1])
    mem.arena.free([mem._pages.pop("f1")])  # its only K/V lost
    before = store_files(tmp_path)
    for call in (mem.save, lambda: mem.kv("f1")):
        with pytest.raises(KVStackError, match=r"facts \['f1'\] have no K/V"):
            call()
    assert store_files(tmp_path) == before


# --------------------------------------------------------------------------- RoPE it refuses
@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "short_factor": [1.0] * 8,  # head_dim 16: one per rotated pair
            "long_factor": [2.0] * 8,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_a_rope_whose_frequencies_depend_on_the_length_is_refused(rope_parameters):
    config = tiny_llama_config(rope_parameters=rope_parameters, max_position_embeddings=512)
    kind = rope_parameters["rope_type"]
    with pytest.raises(KVStackError, match=f"rope_type='{kind}': its frequencies depend"):
        FactMemory(LlamaForCausalLM(config), ByteTokenizer(), embedder=word_embedder)


def test_partial_rotary_is_refused_and_every_fixed_rope_type_is_accepted():
    from transformers import PhiConfig, PhiForCausalLM

    config = PhiConfig(**TINY_LLAMA)  # Phi rotates half of each head (partial_rotary_factor 0.5)
    with pytest.raises(KVStackError, match="partial rotary .*8 of head_dim 16"):
        FactMemory(PhiForCausalLM(config), ByteTokenizer(), embedder=word_embedder)
    for rope in sorted(ROPE_PARAMETERS):  # default, linear, llama3, yarn
        assert len(memory(tiny_model(rope))) == 0


def test_transfer_params_name_the_store_by_an_absolute_path(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kvstack.vllm import PARAMS_KEY, transfer_params

    monkeypatch.chdir(tmp_path)
    params = transfer_params(SimpleNamespace(path=Path("stores/memory")), ["f1"])
    # vLLM's processes need not share this working directory.
    assert params[PARAMS_KEY] == {"store": str(tmp_path / "stores" / "memory"), "facts": ["f1"]}
    with pytest.raises(InvalidArgumentError, match="memory has no path"):
        transfer_params(SimpleNamespace(path=None), ["f1"])
