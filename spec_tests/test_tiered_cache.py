"""TieredCache under generate: exactly DynamicCache's tokens while most of the KV sits on host
and disk, on a tiny model (every tier and rule) and on SmolLM2 with 25 % of the KV on device."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from transformers import DynamicCache

from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.tiers import ATTENTION_NAME, TieredCache
from spec_tests.tiny import tiny_tiers_llama


def greedy(model, ids, cache, new_tokens, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(
            ids,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
            **kwargs,
        )


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_tiers_llama()


@contextlib.contextmanager
def tiers_attention(model):
    """The model runs the "kvstack_tiers" attention inside the block (sdpa outside it)."""
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize(
    "policy,placement",
    [("lru", "recency"), ("cost", "recency"), ("attention", "attention"), ("lru", "attention")],
)
def test_tokens_equal_dynamic_cache_with_pages_on_host_and_disk(
    tiny_model, tmp_path, policy, placement
):
    check_tokens_with_pages_on_host_and_disk(tiny_model, tmp_path, policy, placement)


def test_without_a_prefetch_worker_each_page_is_fetched_when_read_with_the_same_tokens(
    tiny_model, tmp_path
):
    cache = check_tokens_with_pages_on_host_and_disk(
        tiny_model, tmp_path, "cost", "recency", prefetch_workers=0, close=False
    )
    assert cache.prefetcher._pool is None and not cache.prefetcher._pending  # nothing ahead
    # Every fetch ran on the model's thread: its whole time was waited for.
    assert cache.prefetcher.transfer_seconds > 0
    assert cache.prefetcher.overlap_fraction == pytest.approx(0.0, abs=1e-9)
    cache.close()


def check_tokens_with_pages_on_host_and_disk(
    tiny_model, tmp_path, policy, placement, close=True, **options
):
    ids = torch.randint(1, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 30)
    page = 2 * 16 * 2 * 16 * 4  # K and V of 16 tokens, 2 KV heads of 16 dims, fp32
    scored = policy == "attention" or placement == "attention"
    with tiers_attention(tiny_model) if scored else contextlib.nullcontext():
        cache = TieredCache(
            tiny_model.config,
            device_budget=3 * page,
            host_budget=3 * page,
            disk_path=tmp_path,
            disk_budget="1MiB",
            policy=policy,
            placement=placement,
            **options,
        )
        got = greedy(tiny_model, ids, cache, 30)
    assert torch.equal(got, expected)
    share = cache.stats()["device_attention_share"]
    assert (share is None) if not scored else (0.0 < share < 1.0)
    stats = cache.stats()
    assert stats["seen_tokens"] == 119  # 90 + 30 - 1: the last token is never fed back
    assert stats["pages"] == 3 * (119 // 16)
    assert stats["pages_homed"]["disk"] > 0 and stats["pages_homed"]["host"] == 3
    assert stats["bytes_used"]["device"] <= 3 * page
    assert stats["hits"]["disk"] > 0 and stats["fetched_bytes"]["disk"] > 0
    cache.store.check()
    if close:
        cache.close()
    return cache


def test_a_reset_cache_serves_a_second_prompt_exactly(tiny_model, tmp_path):
    cache = TieredCache(
        tiny_model.config,
        device_budget="8KiB",
        host_budget="8KiB",
        disk_path=tmp_path,
        disk_budget="1MiB",
    )
    for seed in (2, 3):
        ids = torch.randint(1, 256, (1, 50), generator=torch.Generator().manual_seed(seed))
        expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 10)
        cache.reset()
        assert torch.equal(greedy(tiny_model, ids, cache, 10), expected)
    cache.close()


def test_bad_arguments_are_refused_before_anything_is_built(tiny_model, tmp_path):
    with pytest.raises(InvalidArgumentError, match="policy='fifo'"):
        TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0, policy="fifo")
    with pytest.raises(
        InvalidArgumentError, match="device_budget=100 cannot hold one page of 4096"
    ):
        TieredCache(tiny_model.config, device_budget=100, host_budget=0)
    with pytest.raises(InvalidArgumentError, match="disk_path=.*not a writable directory"):
        (tmp_path / "file").write_text("x")
        TieredCache(
            tiny_model.config,
            device_budget="1MiB",
            host_budget=0,
            disk_path=tmp_path / "file",
            disk_budget="1MiB",
        )


@pytest.mark.parametrize("workers", [-1, 1.5, True, "2"])
def test_a_bad_prefetch_worker_count_is_refused_before_the_directory_is_made(
    tiny_model, tmp_path, workers
):
    disk = tmp_path / "pages"
    with pytest.raises(InvalidArgumentError, match=f"prefetch_workers={workers!r}; expected"):
        TieredCache(
            tiny_model.config,
            device_budget="1MiB",
            host_budget=0,
            disk_path=disk,
            disk_budget="1MiB",
            prefetch_workers=workers,
        )
    assert not disk.exists()


def test_budgets_too_small_for_the_sequence_raise_tier_full(tiny_model):
    from kvstack.errors import TierFull

    ids = torch.randint(1, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    cache = TieredCache(tiny_model.config, device_budget=4096, host_budget=4096)
    with pytest.raises(TierFull, match="host tier: 4096 bytes needed, 0 of 4096 free"):
        greedy(tiny_model, ids, cache, 4)
    # After the failed step the cache is reset; with room it then serves exactly.
    cache.reset()
    cache.store.check()
    assert cache.store.pages == {}
    ids = ids[:, :10]  # 13 tokens: each layer's tail, no page
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 4)
    assert torch.equal(greedy(tiny_model, ids, cache, 4), expected)


def test_beam_search_is_refused_with_a_clear_error(tiny_model):
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    cache = TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0)
    with pytest.raises(KVStackError, match="num_beams=1"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tiny_model.generate(
                ids, past_key_values=cache, max_new_tokens=3, num_beams=2, do_sample=False
            )


@pytest.mark.slow
@pytest.mark.parametrize("merge_segments", [False, True], ids=["gathered", "segments"])
def test_smollm2_with_a_quarter_of_the_kv_on_device_makes_dynamic_cache_tokens(
    tmp_path, merge_segments
):
    from kvstack.models import load_smollm2
    from spec_tests.test_hf_smollm2 import PROMPT, chat_ids

    model, tokenizer = load_smollm2(progress=False)
    model.set_attn_implementation("sdpa")
    ids = chat_ids(tokenizer, [PROMPT])["input_ids"]
    new = 40
    expected = greedy(model, ids, DynamicCache(config=model.config), new)
    if merge_segments:  # multi-segment attention runs on the tiers attention
        model.set_attn_implementation(ATTENTION_NAME)
    tokens = ids.shape[1] + new - 1
    kv_bytes = 30 * 2 * tokens * 3 * 64 * 4  # 30 layers, K and V, 3 KV heads of 64, fp32
    cache = TieredCache(
        model.config,
        device_budget=kv_bytes // 4,
        host_budget=kv_bytes // 4,
        disk_path=tmp_path,
        disk_budget="64MiB",
        policy="cost",
        merge_segments=merge_segments,
    )
    got = greedy(model, ids, cache, new)
    assert torch.equal(got, expected), tokenizer.decode(got[0, ids.shape[1] :])
    assert cache.attends_by_segments() == merge_segments
    stats = cache.stats()
    assert stats["bytes_used"]["device"] <= kv_bytes // 4
    assert stats["pages_homed"]["disk"] > 0
    cache.close()


# --------------------------------------------------------------------------- save and resume
FIRST_TURN = """
import sys, torch
from transformers import LlamaForCausalLM
from kvstack.tiers import TieredCache
from spec_tests.tiny import tiny_llama_config

weights, disk_path, ids_path, out_path = sys.argv[1:]
model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
model.load_state_dict(torch.load(weights))
model.generation_config.pad_token_id = 0
ids = torch.load(ids_path)
cache = TieredCache(model.config, device_budget="8KiB", host_budget="8KiB", disk_path=disk_path,
                    disk_budget="1MiB", policy="cost")
out = model.generate(ids, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
cache.save(out)
torch.save(out, out_path)
"""

BUDGETS = dict(device_budget="8KiB", host_budget="8KiB", disk_budget="1MiB", policy="cost")


def first_turn_in_another_process(model, tmp_path):
    import subprocess
    import sys

    weights, ids_path, out_path = tmp_path / "w.pt", tmp_path / "ids.pt", tmp_path / "out.pt"
    torch.save(model.state_dict(), weights)
    torch.save(torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(6)), ids_path)
    disk_path = tmp_path / "conversation"
    subprocess.run(
        [
            sys.executable,
            "-c",
            FIRST_TURN,
            str(weights),
            str(disk_path),
            str(ids_path),
            str(out_path),
        ],
        check=True,
        env={
            **__import__("os").environ,
            "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1]),
        },
    )
    return disk_path, torch.load(out_path)


def test_a_conversation_saved_by_one_process_resumes_in_another_with_identical_tokens(
    tiny_model, tmp_path
):
    disk_path, first = first_turn_in_another_process(tiny_model, tmp_path)
    next_turn = torch.randint(1, 256, (1, 15), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([first, next_turn], dim=1)  # the whole conversation, as a chat would send it
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 10)
    cache = TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=ids, **BUDGETS)
    assert cache.get_seq_length() == first.shape[1] - 1  # its last token was never fed back
    got = greedy(tiny_model, ids, cache, 10)
    assert torch.equal(got, expected)
    stats = cache.stats()
    assert stats["hits"]["disk"] > 0  # the first turn's K/V came from the saved pages
    cache.store.check()
    cache.close()
    again = TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=ids, **BUDGETS)
    assert torch.equal(greedy(tiny_model, ids, again, 10), expected)  # the save is intact
    again.close()


def test_resume_refuses_other_tokens_another_geometry_and_a_damaged_manifest(tiny_model, tmp_path):
    from kvstack.errors import PageCorrupted

    disk_path, first = first_turn_in_another_process(tiny_model, tmp_path)
    other = first.clone()
    other[0, 5] = (other[0, 5] + 1) % 256
    with pytest.raises(InvalidArgumentError, match="token_ids do not start with the 51 tokens"):
        TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=other, **BUDGETS)
    with pytest.raises(InvalidArgumentError, match="saved for .*'block_size': 16"):
        TieredCache.resume(
            tiny_model.config, disk_path=disk_path, token_ids=first, block_size=8, **BUDGETS
        )
    with pytest.raises(InvalidArgumentError, match="holds no saved conversation"):
        TieredCache.resume(
            tiny_model.config, disk_path=tmp_path / "empty", token_ids=first, **BUDGETS
        )
    manifest = disk_path / "conversation.json"
    data = bytearray(manifest.read_bytes())
    data[-2] ^= 1
    manifest.write_bytes(bytes(data))
    with pytest.raises(PageCorrupted, match="conversation.json"):
        TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=first, **BUDGETS)


def test_a_corrupt_saved_page_raises_instead_of_attending_to_wrong_keys(tiny_model, tmp_path):
    from kvstack.errors import PageCorrupted

    disk_path, first = first_turn_in_another_process(tiny_model, tmp_path)
    page = disk_path / "L1.B0.page"
    data = bytearray(page.read_bytes())
    data[-5] ^= 0x40
    page.write_bytes(bytes(data))
    cache = TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=first, **BUDGETS)
    with pytest.raises(PageCorrupted, match="L1.B0.page"):
        greedy(tiny_model, first, cache, 2)
    cache.close()


def test_a_batch_of_two_makes_dynamic_cache_tokens_and_its_page_size_is_checked(
    tiny_model, tmp_path
):
    ids = torch.randint(1, 256, (2, 40), generator=torch.Generator().manual_seed(8))
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 8)
    cache = TieredCache(
        tiny_model.config,
        device_budget="16KiB",
        host_budget="16KiB",
        disk_path=tmp_path,
        disk_budget="1MiB",
    )
    assert torch.equal(greedy(tiny_model, ids, cache, 8), expected)
    assert cache.stats()["pages_homed"]["disk"] > 0
    small = TieredCache(tiny_model.config, device_budget=4096, host_budget=0)  # one row's page
    with pytest.raises(
        InvalidArgumentError, match="device_budget=4096 cannot hold one page of this batch \\(8192"
    ):
        greedy(tiny_model, ids, small, 2)
    assert small.store.pages == {}


def test_a_cache_for_another_device_and_a_directory_with_pages_are_refused(tiny_model, tmp_path):
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(9))
    cache = TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0, device="meta")
    with pytest.raises(KVStackError, match="built with device='meta'.*on cpu"):
        greedy(tiny_model, ids, cache, 2)
    first = TieredCache(
        tiny_model.config, device_budget=4096, host_budget=0, disk_path=tmp_path, disk_budget="1MiB"
    )
    greedy(tiny_model, torch.randint(1, 256, (1, 40)), first, 2)  # pages on disk
    with pytest.raises(InvalidArgumentError, match="already holds pages"):
        TieredCache(
            tiny_model.config,
            device_budget="1MiB",
            host_budget=0,
            disk_path=tmp_path,
            disk_budget="1MiB",
        )


# --------------------------------------------------------------------------- hybrid models
HYBRIDS_WITH_STATE_LAYERS = ["jamba", "bamba", "qwen3_next", "lfm2", "nemotron_h"]


def tiny_hybrid(name: str):
    from transformers import AutoModelForCausalLM

    from kvstack.models import tiny_hybrid_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config(name), attn_implementation="eager")
    return model.eval()


def hybrid_budgets(config, tmp_path) -> dict:
    """Two pages on device, two on host, the rest on disk."""
    page = TieredCache(config, device_budget="1MiB", host_budget=0).page_bytes
    return dict(
        device_budget=2 * page, host_budget=2 * page, disk_path=tmp_path, disk_budget="4MiB"
    )


@pytest.mark.parametrize("name", HYBRIDS_WITH_STATE_LAYERS)
def test_a_hybrid_model_saves_and_resumes_its_recurrent_state_with_the_kv(name, tmp_path):
    """Attention K/V tiered, state layers on the device; the state reaches disk with the KV on
    save() and comes back on resume(): the next turn makes exactly DynamicCache's tokens."""
    model = tiny_hybrid(name)
    ids = torch.randint(2, 120, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = TieredCache(model.config, **hybrid_budgets(model.config, tmp_path / "kv"))
    first = greedy(model, ids, cache, 12)
    assert torch.equal(first, greedy(model, ids, DynamicCache(config=model.config), 12))
    assert cache.stats()["state_bytes"] > 0 and cache.stats()["pages_homed"]["disk"] > 0
    cache.save(first)
    saved_states = {name: state.clone() for name, state in cache._states().items()}
    cache.close()
    turn = torch.randint(2, 120, (1, 6), generator=torch.Generator().manual_seed(4))
    whole = torch.cat([first, turn], dim=1)
    budgets = hybrid_budgets(model.config, tmp_path / "kv")
    resumed = TieredCache.resume(model.config, token_ids=whole, **budgets)
    assert resumed.get_seq_length() == first.shape[1] - 1 and resumed.resume_miss is None
    restored = resumed._states()
    assert restored.keys() == saved_states.keys()
    assert all(torch.equal(restored[name], saved_states[name]) for name in saved_states)
    got = greedy(model, whole, resumed, 8)
    assert torch.equal(got, greedy(model, whole, DynamicCache(config=model.config), 8))
    resumed.close()


def saved_hybrid_conversation(path):
    """A tiny Jamba's 40-token prompt and 6 greedy tokens, saved under ``path``: (model, prompt
    ids, the budgets it was saved with, the saved token ids)."""
    model = tiny_hybrid("jamba")
    ids = torch.randint(2, 120, (1, 40), generator=torch.Generator().manual_seed(3))
    budgets = hybrid_budgets(model.config, path)
    cache = TieredCache(model.config, **budgets)
    first = greedy(model, ids, cache, 6)
    cache.save(first)
    cache.close()
    return model, ids, budgets, first


def test_a_saved_kv_without_its_state_is_a_miss_and_is_recomputed_not_continued(tmp_path):
    """A state page that is gone or damaged makes the whole saved conversation a miss: resume
    warns, deletes it and returns an empty cache, so generate recomputes every token (the same
    tokens); continuing the K/V from zeroed states would be silently wrong."""
    model, ids, budgets, first = saved_hybrid_conversation(tmp_path / "kv")
    state_pages = sorted((tmp_path / "kv").glob("L*.state.*.page"))
    assert state_pages
    for damage in ("corrupt", "missing"):
        if damage == "corrupt":
            data = bytearray(state_pages[0].read_bytes())
            data[-3] ^= 0x10
            state_pages[0].write_bytes(bytes(data))
        else:  # save again, then lose the state page
            again = TieredCache(model.config, **budgets)
            greedy(model, ids, again, 6)
            again.save(first)
            again.close()
            state_pages[0].unlink()
        with pytest.warns(UserWarning, match="state page .*is a miss"):
            missed = TieredCache.resume(model.config, token_ids=first, **budgets)
        assert missed.resume_miss is not None and missed.get_seq_length() == 0
        assert not list((tmp_path / "kv").glob("*.page"))
        with pytest.raises(InvalidArgumentError, match="holds no saved conversation"):
            TieredCache.saved_token_ids(tmp_path / "kv")
        got = greedy(model, first, missed, 4)
        assert torch.equal(got, greedy(model, first, DynamicCache(config=model.config), 4))
        missed.reset()
        missed.close()


def test_models_tiered_cache_cannot_page_are_refused_by_name():
    from kvstack.models import tiny_hybrid_config

    with pytest.raises(KVStackError, match="layer .* is a LinearAttentionAndFullAttentionLayer"):
        TieredCache(tiny_hybrid_config("falcon_h1"), device_budget="1MiB", host_budget=0)


@pytest.mark.parametrize(
    "key, damage, kept_tokens",
    [
        ("L1.B2", "corrupt", 32),  # blocks 0 and 1 are whole in every layer
        ("L0.B1", "missing", 16),
        ("L0.B0", "corrupt", 0),  # nothing usable: generate recomputes all of it
        ("L2.tail.1", "corrupt", 48),  # every block whole, the partial one lost
    ],
)
def test_resume_in_lossless_mode_recomputes_from_the_first_damaged_page(
    tiny_model, tmp_path, key, damage, kept_tokens
):
    disk_path, first = first_turn_in_another_process(tiny_model, tmp_path)  # 51 tokens saved
    page = disk_path / f"{key}.page"
    if damage == "missing":
        page.unlink()
    else:
        data = bytearray(page.read_bytes())
        data[-7] ^= 0x08
        page.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=f"{key}.*from token {kept_tokens} on are recomputed"):
        cache = TieredCache.resume(
            tiny_model.config, disk_path=disk_path, token_ids=first, damaged="recompute", **BUDGETS
        )
    assert cache.get_seq_length() == kept_tokens and key in cache.resume_damage
    left = {path.name for path in disk_path.glob("*.page")}
    assert left == {
        f"L{layer}.B{block}.page" for layer in range(3) for block in range(kept_tokens // 16)
    }
    expected = greedy(tiny_model, first, DynamicCache(config=tiny_model.config), 6)
    assert torch.equal(greedy(tiny_model, first, cache, 6), expected)
    cache.close()
    # The manifest was rewritten: the next resume, in the default mode, finds the shorter
    # conversation whole.
    assert TieredCache.saved_token_ids(disk_path).tolist() == [first[0, :kept_tokens].tolist()]
    again = TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=first, **BUDGETS)
    assert again.get_seq_length() == kept_tokens and again.resume_damage is None
    assert torch.equal(greedy(tiny_model, first, again, 6), expected)
    again.close()


def test_a_save_that_fails_before_its_manifest_leaves_the_previous_save_in_force(
    tiny_model, tmp_path, monkeypatch
):
    """Tails and states are written under names of their save; the previous save's are
    deleted only after the new manifest is written."""
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(8))
    cache = TieredCache(tiny_model.config, disk_path=tmp_path, **BUDGETS)
    first = greedy(tiny_model, ids, cache, 5)
    cache.save(first)
    second = greedy(tiny_model, first, cache, 20)  # the cache continues past the first save

    def killed(*args, **kwargs):
        raise OSError("the process died here")

    monkeypatch.setattr(cache.store.disk, "write_record", killed)
    with pytest.raises(OSError, match="died here"):
        cache.save(second)
    monkeypatch.undo()
    cache.prefetcher.close()  # the process is gone; its page files stay
    assert not list(tmp_path.glob("*.tail.2.page"))  # the failed save's own pages are gone
    resumed = TieredCache.resume(tiny_model.config, disk_path=tmp_path, token_ids=first, **BUDGETS)
    assert resumed.get_seq_length() == first.shape[1] - 1
    expected = greedy(tiny_model, first, DynamicCache(config=tiny_model.config), 6)
    assert torch.equal(greedy(tiny_model, first, resumed, 6), expected)
    resumed.close()


def test_a_resumed_save_stays_whole_when_placement_moves_its_pages_up(tiny_model, tmp_path):
    """A resumed conversation's pages are homed on disk; the next turn's prefill places the
    most attended ones on device and host. Their files stay, as copies (the save in force
    names them): a second process resumes the same save with the same tokens."""
    disk_path, first = first_turn_in_another_process(tiny_model, tmp_path)
    ids = torch.cat(
        [first, torch.randint(1, 256, (1, 15), generator=torch.Generator().manual_seed(7))], 1
    )
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 6)
    saved = {path.name for path in disk_path.glob("*.page")}
    with tiers_attention(tiny_model):
        cache = TieredCache.resume(
            tiny_model.config, disk_path=disk_path, token_ids=ids, placement="attention", **BUDGETS
        )
        assert cache.store.keep_on_disk == {name.removesuffix(".page") for name in saved}
        assert torch.equal(greedy(tiny_model, ids, cache, 6), expected)
    moved_up = [k for k in cache.store.keep_on_disk if cache.store.pages[k].home != "disk"]
    assert moved_up  # placement moved saved pages up; each kept its file
    assert all("disk" in cache.store.tiers_of(k) for k in moved_up)
    cache.store.check()
    cache.prefetcher.close()  # the process is gone; its page files stay
    assert saved <= {path.name for path in disk_path.glob("*.page")}
    again = TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=ids, **BUDGETS)
    assert torch.equal(greedy(tiny_model, ids, again, 6), expected)
    again.reset()
    assert again.store.keep_on_disk == set()  # reset deletes the save in force
    again.close()


def test_resume_raises_page_corrupted_for_a_saved_page_whose_file_is_gone(tiny_model, tmp_path):
    from kvstack.errors import PageCorrupted

    disk_path, first = first_turn_in_another_process(tiny_model, tmp_path)
    (disk_path / "L1.B0.page").unlink()
    with pytest.raises(PageCorrupted, match="'L1.B0' of the conversation saved in .* no file"):
        TieredCache.resume(tiny_model.config, disk_path=disk_path, token_ids=first, **BUDGETS)


def test_resume_refuses_an_unknown_damage_mode(tiny_model, tmp_path):
    with pytest.raises(InvalidArgumentError, match="damaged='ignore'; expected 'raise' or"):
        TieredCache.resume(
            tiny_model.config, disk_path=tmp_path, token_ids=[1], damaged="ignore", **BUDGETS
        )


def test_a_hybrid_with_a_damaged_kv_page_is_a_miss_in_lossless_mode(tmp_path):
    """Its recurrent state belongs to the end of the saved tokens and cannot be rewound to the
    intact prefix: the whole conversation is recomputed."""
    model, ids, budgets, first = saved_hybrid_conversation(tmp_path / "kv")
    page = sorted((tmp_path / "kv").glob("L*.B1.page"))[0]
    data = bytearray(page.read_bytes())
    data[-7] ^= 0x08
    page.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=f"{page.stem}.*is a miss"):
        missed = TieredCache.resume(model.config, token_ids=first, damaged="recompute", **budgets)
    assert missed.get_seq_length() == 0
    got = greedy(model, first, missed, 4)
    assert torch.equal(got, greedy(model, first, DynamicCache(config=model.config), 4))
    missed.close()


# --------------------------------------------------------------------------- attention scores
def test_placement_at_prefill_puts_the_most_attended_pages_on_device_then_host(
    tiny_model, tmp_path
):
    ids = torch.randint(1, 256, (1, 120), generator=torch.Generator().manual_seed(6))
    page = 2 * 16 * 2 * 16 * 4
    with tiers_attention(tiny_model):
        cache = TieredCache(
            tiny_model.config,
            device_budget=4 * page,
            host_budget=5 * page,
            disk_path=tmp_path,
            disk_budget="1MiB",
            placement="attention",
        )
        greedy(tiny_model, ids, cache, 1)  # the prefill only: its scores placed the pages
    pages = cache.store.pages
    # Every page was scored once, at prefill (from 0, so its running average is half its share).
    assert all(info.attention > 0 for info in pages.values())
    ranked = sorted(pages, key=lambda k: (-pages[k].attention, k))
    assert [pages[k].home for k in ranked] == ["device"] * 4 + ["host"] * 5 + ["disk"] * (
        len(ranked) - 9
    )
    cache.store.check()
    cache.close()


def test_a_reset_after_a_prefill_that_failed_part_way_serves_a_shorter_prompt(tiny_model):
    """Placement by attention collects each layer's page scores until the last layer; a
    prefill that stops at layer 1 (the tiers are full) leaves layer 0's, which reset() clears:
    the next prompt is placed by its own scores and makes DynamicCache's tokens."""
    from kvstack.errors import TierFull

    page = 2 * 16 * 2 * 16 * 4
    long_ids = torch.randint(1, 256, (1, 120), generator=torch.Generator().manual_seed(6))
    short_ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(7))
    with tiers_attention(tiny_model):
        cache = TieredCache(
            tiny_model.config,
            device_budget=4 * page,
            host_budget=4 * page,
            placement="attention",
        )
        with pytest.raises(TierFull):
            greedy(tiny_model, long_ids, cache, 1)  # 7 pages a layer: layer 1 finds no room
        cache.reset()
        got = greedy(tiny_model, short_ids, cache, 6)
    assert torch.equal(
        got, greedy(tiny_model, short_ids, DynamicCache(config=tiny_model.config), 6)
    )
    cache.store.check()
    cache.close()


def test_attention_scores_are_required_where_the_cache_ranks_by_them(tiny_model):
    for kwargs in (
        dict(policy="attention"),
        dict(placement="attention"),
        dict(track_attention=True),
    ):
        with pytest.raises(InvalidArgumentError, match="attn_implementation='kvstack_tiers'"):
            TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0, **kwargs)
    with pytest.raises(InvalidArgumentError, match="placement='snapkv'"):
        TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0, placement="snapkv")
    with pytest.raises(InvalidArgumentError, match="track_attention=1"):
        TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0, track_attention=1)
    # Built for the scored attention, then run on another: the first step says so.
    with tiers_attention(tiny_model):
        cache = TieredCache(
            tiny_model.config, device_budget="1MiB", host_budget=0, policy="attention"
        )
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(7))
    with pytest.raises(KVStackError, match="only the 'kvstack_tiers' attention reports"):
        greedy(tiny_model, ids, cache, 2)


def test_scores_are_computed_only_for_a_cache_that_asks_for_them(tiny_model, monkeypatch):
    from kvstack.tiers import attention as tiers_attention_module

    calls = []
    real = tiers_attention_module.segments_attention_mass  # key_attention_mass calls it too
    monkeypatch.setattr(
        tiers_attention_module,
        "segments_attention_mass",
        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs),
    )
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(8))
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 4)
    with tiers_attention(tiny_model):
        plain = TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0)
        assert torch.equal(greedy(tiny_model, ids, plain, 4), expected)
        assert calls == [] and plain.stats()["device_attention_share"] is None
        tracked = TieredCache(
            tiny_model.config, device_budget="1MiB", host_budget=0, track_attention=True
        )
        assert torch.equal(greedy(tiny_model, ids, tracked, 4), expected)
    assert len(calls) == 3 * 4  # every layer of the prefill and the three decode steps
    assert tracked.stats()["device_attention_share"] == pytest.approx(1.0)  # all on device
