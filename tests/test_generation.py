"""Generation: sampling, stop conditions, sessions (KV state reuse), context limits, chat."""

from __future__ import annotations

import pytest
import torch

import expertcache
from expertcache import ExpertCacheError


@pytest.fixture
def model(tiny_checkpoint):
    _, d = tiny_checkpoint("qwen3_moe")
    return expertcache.load(d, ctx_size=128)


PROMPT = [5, 9, 17, 33, 60, 7]


def test_same_seed_same_text(model):
    a = model.generate(PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    b = model.generate(PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    c = model.generate(PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=12, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_top_k_one_and_min_p_one_are_greedy(model):
    greedy = model.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids
    assert model.generate(PROMPT, max_tokens=16, temperature=1.5, top_k=1, seed=3, ignore_eos=True).token_ids == greedy
    assert model.generate(PROMPT, max_tokens=16, temperature=1.5, min_p=1.0, seed=3, ignore_eos=True).token_ids == greedy


def test_greedy_equals_argmax_of_full_forward(model):
    res = model.generate(PROMPT, max_tokens=10, ignore_eos=True)
    seq = PROMPT + res.token_ids
    logits = model.logits(seq)
    assert res.token_ids == logits[len(PROMPT) - 1: -1].argmax(-1).tolist()


def test_eos_stops(model):
    # Find what greedy generates, then declare its 3rd token the EOS.
    ids = model.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    model.eos_ids = {ids[2]}
    res = model.generate(PROMPT, max_tokens=8)
    assert res.token_ids == ids[:ids.index(ids[2])] and res.finish_reason == "stop"


def test_stop_string_and_max_tokens(model):
    full = model.generate(PROMPT, max_tokens=12, ignore_eos=True)
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    words = full.text.split()
    stop = words[3]
    res = model.generate(PROMPT, max_tokens=12, stop=[stop], ignore_eos=True)
    assert res.finish_reason == "stop"
    assert res.text == full.text[: full.text.index(stop)]
    streamed = []
    model.generate(PROMPT, max_tokens=12, stop=[stop], ignore_eos=True, on_text=streamed.append)
    assert "".join(streamed) == res.text


def test_ubatch_does_not_change_results(model):
    prompt = list(range(4, 70))
    a = model.generate(prompt, max_tokens=8, ubatch=512, ignore_eos=True)
    b = model.generate(prompt, max_tokens=8, ubatch=7, ignore_eos=True)
    assert a.token_ids == b.token_ids


def test_session_reuses_prefix_and_matches_fresh(model):
    session = model.new_session()
    first = model.generate(PROMPT, max_tokens=6, session=session, ignore_eos=True)
    assert first.cached_tokens == 0
    follow = PROMPT + first.token_ids + [40, 41, 42]
    again = model.generate(follow, max_tokens=6, session=session, ignore_eos=True)
    assert again.cached_tokens == len(PROMPT) + len(first.token_ids) - 1
    fresh = model.generate(follow, max_tokens=6, ignore_eos=True)
    assert again.token_ids == fresh.token_ids


def test_session_copy_and_truncate(model):
    s = model.new_session()
    model.prefill(s, PROMPT)
    c = s.copy()
    c.truncate(3)
    assert s.kv.length == len(PROMPT) and c.kv.length == 3 and c.tokens == PROMPT[:3]
    a = model.prefill(c, PROMPT[3:])
    b = model.prefill(model.new_session(), PROMPT)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_prompt_longer_than_context_is_an_error(model):
    with pytest.raises(ExpertCacheError, match="do not fit the context of 128"):
        model.generate(list(range(4, 4 + 129)), max_tokens=1)


def test_generation_stops_at_context_end(model):
    res = model.generate(list(range(4, 4 + 120)), max_tokens=50, ignore_eos=True)
    assert len(res.token_ids) == 128 - 120 + 1 and res.finish_reason == "length"


def test_chat_uses_template(model):
    res = model.chat([{"role": "user", "content": "w1 w2"}], max_tokens=4, ignore_eos=True)
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "w1 w2"}])
    assert res.prompt_tokens == len(ids)
    assert res.token_ids == model.generate(ids, max_tokens=4, ignore_eos=True).token_ids


def test_top_p_zero_keeps_the_likeliest_token_alone(model):
    greedy = model.generate(PROMPT, max_tokens=12, ignore_eos=True).token_ids
    for seed in (1, 2):
        got = model.generate(PROMPT, max_tokens=12, temperature=2.0, top_p=0.0, seed=seed, ignore_eos=True)
        assert got.token_ids == greedy
    # Without it, that temperature strays from the greedy tokens (the test above means something).
    assert model.generate(PROMPT, max_tokens=12, temperature=2.0, seed=1, ignore_eos=True).token_ids != greedy


def test_should_stop_is_asked_at_each_generated_token(model):
    # Without on_text (or while text is held back as a possible stop string) nothing else asks:
    # a client that left must still stop the generation at its next token.
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) > 5

    res = model.generate(PROMPT, max_tokens=40, ignore_eos=True, should_stop=should_stop)
    assert res.finish_reason == "abort" and len(res.token_ids) == 5
    # All of the text held back: the stop string is the whole answer and more.
    whole = model.generate(PROMPT, max_tokens=40, ignore_eos=True).text
    held = model.generate(PROMPT, max_tokens=40, ignore_eos=True, stop=[whole + " zz"], on_text=lambda piece: None,
                          should_stop=lambda: True)
    assert held.finish_reason == "abort" and held.token_ids == []


def test_an_aborted_prompt_reports_the_tokens_it_processed(tiny_checkpoint):
    _, d = tiny_checkpoint("qwen3_moe")
    model = expertcache.load(d, ctx_size=128, prefill_stretch=4)
    calls = []
    res = model.generate(list(range(5, 17)), max_tokens=3,
                         should_stop=lambda: bool(calls.append(1)) or len(calls) > 1)
    assert res.finish_reason == "abort"
    # Asked before each stretch after the first: two stretches of 4 tokens ran, the third did not.
    assert res.prompt_tokens == 12 and res.timings()["prompt_n"] == model.last_prefill.tokens == 8


def test_bad_sampling_values(model):
    for kwargs in ({"temperature": -1}, {"top_p": -0.1}, {"top_p": 1.01}, {"min_p": 2}, {"top_k": -1},
                   {"max_tokens": -1}):
        with pytest.raises(ExpertCacheError):
            model.generate(PROMPT, **kwargs)


def test_streamed_text_never_holds_part_of_a_stop_string(model):
    full = model.generate(PROMPT, max_tokens=12, ignore_eos=True)
    words = full.text.split()
    # Stop strings that begin in one token's text and end in a later one's.
    for stop in (f"{words[2][-1]} {words[3]}", f"{words[4]} {words[5]} {words[6][:2]}"):
        streamed = []
        res = model.generate(PROMPT, max_tokens=12, stop=[stop], ignore_eos=True, on_text=streamed.append)
        assert res.finish_reason == "stop" and res.text == full.text[: full.text.index(stop)]
        assert "".join(streamed) == res.text
    # A prefix of a stop string that the text then leaves is streamed after all.
    streamed = []
    res = model.generate(PROMPT, max_tokens=12, stop=[f"{words[3]} nothing"], ignore_eos=True,
                         on_text=streamed.append)
    assert res.finish_reason == "length" and "".join(streamed) == res.text == full.text


def test_stop_may_be_one_string(model):
    full = model.generate(PROMPT, max_tokens=12, ignore_eos=True)
    stop = full.text.split()[3]
    as_list = model.generate(PROMPT, max_tokens=12, stop=[stop], ignore_eos=True)
    assert as_list.text and model.generate(PROMPT, max_tokens=12, stop=stop, ignore_eos=True).text == as_list.text


def test_unseeded_sampling_leaves_torchs_generator_alone(model):
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    model.generate(PROMPT, max_tokens=2, temperature=0.8)
    assert torch.equal(torch.rand(4), expected)


def test_api_misuse_is_an_error(model, tiny_checkpoint):
    for kwargs, needle in (({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": None}, "max_tokens"),
                           ({"temperature": "0.5"}, "temperature"), ({"temperature": 1, "top_k": 2.5}, "top_k"),
                           ({"temperature": 1, "seed": 1.5}, "seed"), ({"session": object()}, "Session")):
        with pytest.raises(ExpertCacheError, match=needle):
            model.generate(PROMPT, **kwargs)
    with pytest.raises(ExpertCacheError, match="nothing to process"):
        model.logits([])
    session = model.new_session()
    model.prefill(session, PROMPT)
    with pytest.raises(ExpertCacheError, match="truncate"):
        session.truncate(-1)
    assert session.kv.length == len(session.tokens) == len(PROMPT)
    _, d = tiny_checkpoint("qwen3_moe", seed=1)
    other = expertcache.load(d, ctx_size=64)
    for call in (lambda: other.generate(PROMPT, max_tokens=2, session=session),
                 lambda: other.prefill(session, PROMPT), lambda: other.generate(PROMPT, session=session.copy())):
        with pytest.raises(ExpertCacheError, match="another model"):
            call()
    (d / "tokenizer.json").unlink()
    bare = expertcache.load(d, ctx_size=64)
    with pytest.raises(ExpertCacheError, match="tokenizer"):
        bare.generate("w1 w2", max_tokens=2)
    with pytest.raises(ExpertCacheError, match="tokenizer"):
        bare.chat([{"role": "user", "content": "w1"}], max_tokens=2)
    assert len(bare.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2


def test_generation_config_eos_ends_generation(tiny_checkpoint):
    import json

    from transformers import GenerationConfig

    _, d = tiny_checkpoint("qwen3_moe")
    ids = expertcache.load(d, ctx_size=128).generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    end = next(t for t in ids[1:] if t != 1)  # an end-of-turn id named in generation_config.json alone
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, end]}))
    assert end in GenerationConfig.from_pretrained(d).eos_token_id  # where transformers' generate stops
    res = expertcache.load(d, ctx_size=128).generate(PROMPT, max_tokens=8)
    assert res.token_ids == ids[: ids.index(end)] and res.finish_reason == "stop"


def test_run_says_when_the_context_ends(tiny_checkpoint, capsys):
    from conftest import run_cli

    _, d = tiny_checkpoint("qwen3_moe")
    code, err = run_cli(capsys, "run", "-m", str(d), "-p", "w1 w2 w3", "-n", "50", "-c", "8", "--ignore-eos")
    assert code == 0 and "end of the context (8 tokens) after 6 of 50 tokens" in err
    code, err = run_cli(capsys, "run", "-m", str(d), "-p", "w1 w2 w3", "-n", "4", "-c", "8", "--ignore-eos")
    assert code == 0 and "context" not in err
