"""The Python API as a developer calls it: every argument of the wrong type or out of range is one
ExpertCacheError naming it, raised before the prompt runs; token ids in every accepted form give
the same results; a model that is let go closes the files it opened."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import expertcache
from expertcache import CacheConfig, ExpertCacheError

PROMPT = [5, 9, 17, 33, 60, 7, 100, 4, 8, 15, 16, 23, 42]


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")[1]


@pytest.fixture
def model(checkpoint):
    return expertcache.load(checkpoint, ctx_size=64)


def open_files_of(directory) -> int:
    """Descriptors this process holds on files under `directory`."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        n += target.startswith(str(directory))
    return n


@pytest.mark.parametrize("cache", [None, CacheConfig(mode="cache", experts=4, store="mmap"),
                                   CacheConfig(mode="cache", experts=4, store="disk"),
                                   CacheConfig(mode="staging", experts=4, store="disk")])
def test_a_dropped_model_closes_its_checkpoint(checkpoint, cache):
    assert open_files_of(checkpoint) == 0
    for _ in range(3):
        model = expertcache.load(checkpoint, cache=cache)
        model.generate(PROMPT, max_tokens=2)
        assert open_files_of(checkpoint) > 0  # the store reads from the file it holds open
        del model
        gc.collect()
        assert open_files_of(checkpoint) == 0


@pytest.mark.parametrize("store", ["ram", "mmap", "disk"])
def test_a_dropped_gguf_model_closes_its_file(store):
    # The GGUF reader kept its descriptor of the file open after the model was let go.
    path = Path(__file__).resolve().parent / "fixtures" / "gguf" / "olmoe-Q8_0.gguf"
    assert open_files_of(path) == 0
    for _ in range(3):
        model = expertcache.load(path, cache=CacheConfig(mode="cache", fraction=0.5, store=store), ctx_size=32)
        model.logits([1, 2, 3])
        del model
        gc.collect()
        assert open_files_of(path) == 0


def test_a_failed_load_closes_its_checkpoint(checkpoint):
    for _ in range(2):
        with pytest.raises(ExpertCacheError, match="too small"):
            expertcache.load(checkpoint, cache=CacheConfig(mem=10, store="disk"))
    gc.collect()
    assert open_files_of(checkpoint) == 0


def test_generate_arguments_are_checked_before_the_prompt_runs(model):
    ran = model.telemetry()["total"]["ops_seen"]
    for kwargs, needle in (({"stop": 3}, "stop"), ({"stop": ["ok", 3]}, "stop"),
                           ({"ubatch": "4"}, "ubatch"), ({"ubatch": 1.5}, "ubatch"), ({"ubatch": True}, "ubatch"),
                           ({"on_text": 3}, "on_text"), ({"should_stop": "yes"}, "should_stop"),
                           ({"progress": 1}, "progress"), ({"ignore_eos": "no"}, "ignore_eos")):
        with pytest.raises(ExpertCacheError, match=needle):
            model.generate(PROMPT, max_tokens=2, **kwargs)
    assert model.telemetry()["total"]["ops_seen"] == ran


@pytest.mark.parametrize("prompt", [None, 5, 2.5, [5, None], [5.0], torch.tensor([5.0, 9.0]),
                                    torch.tensor([[5, 9], [17, 33]])])
def test_prompts_that_are_not_token_ids(model, prompt):
    for call in (lambda: model.generate(prompt, max_tokens=2), lambda: model.logits(prompt),
                 lambda: model.prefill(model.new_session(), prompt)):
        with pytest.raises(ExpertCacheError, match="token ids"):
            call()


def test_token_ids_in_every_accepted_form_agree(model):
    want = model.logits(PROMPT)
    for form in (tuple(PROMPT), np.array(PROMPT), torch.tensor(PROMPT), torch.tensor([PROMPT]),
                 torch.tensor(PROMPT, dtype=torch.int32)):
        assert torch.equal(model.logits(form), want)
        session = model.new_session()
        assert torch.equal(model.prefill(session, form, all_logits=True), want)
        # The session's tokens are Python ints, as with a list: the next call compares against them.
        assert session.tokens == PROMPT and all(type(t) is int for t in session.tokens)
    greedy = model.generate(PROMPT, max_tokens=4, ignore_eos=True).token_ids
    session = model.new_session()
    res = model.generate(torch.tensor(PROMPT), max_tokens=4, ignore_eos=True, session=session)
    assert res.token_ids == greedy
    assert all(type(t) is int for t in session.tokens)
    assert model.generate(PROMPT + greedy[:2], max_tokens=1, session=session).cached_tokens == len(PROMPT) + 1


def test_prefill_arguments(model):
    for kwargs, needle in (({"ubatch": "8"}, "ubatch"), ({"should_stop": 1}, "should_stop"),
                           ({"progress": "x"}, "progress")):
        session = model.new_session()
        with pytest.raises(ExpertCacheError, match=needle):
            model.prefill(session, PROMPT, **kwargs)
        assert session.tokens == [] and session.kv.length == 0


def test_load_refuses_dtypes_it_cannot_compute_in(checkpoint):
    for dtype in (torch.int32, torch.float64, torch.bool):
        with pytest.raises(ExpertCacheError, match="dtype"):
            expertcache.load(checkpoint, dtype=dtype)
    for dtype in (torch.float32, torch.bfloat16):
        assert expertcache.load(checkpoint, dtype=dtype).net.dtype == dtype


def test_load_path_of_the_wrong_type(checkpoint):
    for path in (3, [str(checkpoint)]):
        with pytest.raises(ExpertCacheError, match="model path"):
            expertcache.load(path)


def test_cache_verify_must_be_a_bool():
    for value in ("no", "false", 1, 0, None):
        with pytest.raises(ExpertCacheError, match="verify"):
            CacheConfig(verify=value)
    assert CacheConfig(verify=True).mode == "cache" and CacheConfig(verify=False).mode == "resident"


def test_resize_cache_takes_a_cache_config(model):
    want = model.logits(PROMPT)
    for bad in (None, {"mode": "cache", "experts": 2}, "cache"):
        with pytest.raises(ExpertCacheError, match="CacheConfig"):
            model.resize_cache(bad)
    assert model.telemetry()["mode"] == "resident"
    assert torch.equal(model.logits(PROMPT), want)


def test_chat_messages_must_be_a_list_of_dicts(model):
    ran = model.telemetry()["total"]["ops_seen"]
    for messages in ("w1 w2", ["w1 w2"], [], {"role": "user", "content": "w1"}, [{"content": "w1"}],
                     [{"role": None, "content": "w1"}]):
        with pytest.raises(ExpertCacheError, match="messages"):
            model.chat(messages, max_tokens=2)
    assert model.telemetry()["total"]["ops_seen"] == ran
    msgs = [{"role": "user", "content": "w1 w2"}]
    ids = model.tokenizer.encode_chat(msgs)
    assert model.chat(msgs, max_tokens=3, ignore_eos=True).token_ids == model.generate(
        ids, max_tokens=3, ignore_eos=True).token_ids


def test_resize_mid_session_changes_no_bit(checkpoint):
    """A session prefilled in two parts with the cache resized (and its policy and mode changed)
    between them: the same logits, bit for bit, as the same two parts on the all-resident path."""
    cut = 5
    resident = expertcache.load(checkpoint)
    s = resident.new_session()
    want = torch.cat([resident.prefill(s, PROMPT[:cut], all_logits=True),
                      resident.prefill(s, PROMPT[cut:], all_logits=True)])
    for first, second in ((CacheConfig(mode="cache", experts=1), CacheConfig(mode="staging", experts=3)),
                          (CacheConfig(mode="cache", experts=3, policy="lru", store="disk"),
                           CacheConfig(mode="cache", experts=2, policy="arc"))):
        model = expertcache.load(checkpoint, cache=first)
        s = model.new_session()
        a = model.prefill(s, PROMPT[:cut], all_logits=True)
        model.resize_cache(second)
        assert model.telemetry()["invalidations"].get("pool", 0) > 0
        b = model.prefill(s, PROMPT[cut:], all_logits=True)
        assert torch.equal(torch.cat([a, b]), want)
        assert model.telemetry()["store"] == first.store


def test_a_session_survives_a_callback_that_raises(model):
    """An exception from `on_text` leaves the session holding the prompt and what was
    generated before it; the next call reuses it and generates what a fresh session does."""
    greedy = model.generate(PROMPT, max_tokens=6, ignore_eos=True)
    session = model.new_session()

    def boom(piece):
        raise RuntimeError("client gone")
    with pytest.raises(RuntimeError, match="client gone"):
        model.generate(PROMPT, max_tokens=6, ignore_eos=True, session=session, on_text=boom)
    assert session.kv.length == len(session.tokens) and session.tokens[:len(PROMPT)] == PROMPT
    res = model.generate(PROMPT, max_tokens=6, ignore_eos=True, session=session)
    assert res.token_ids == greedy.token_ids and res.cached_tokens == len(PROMPT) - 1
