"""`Model.logits` keeps to the prefill budget: a long input runs in stretches of `model.stretch`
tokens (planned from --prefill-stretch/--prefill-mem) and attention micro-batches, as
`prefill(new session, ids, all_logits=True)` runs it, on a session dropped after the call. Checked
by the forwards it makes, bitwise against prefill on each kind of state (keys and values, a
recurrent DeltaNet state, sliding-window rings), against one forward and transformers (fp32),
and for the state it leaves (none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import expertcache
from conftest import attention_calls, build_reference, save_checkpoint, tiny_config
from expertcache.errors import ExpertCacheError
from test_gemma4 import WINDOW, build, ref_logits
from test_prefill_stretch import one_forward  # what `logits` was: one forward over every token

ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "tests" / "fixtures" / "gguf" / "qwen3_5_moe" / "qwen3_5_moe-F32.gguf"
STRETCH = 40
N = 150  # stretches of 40, 40, 40 and 30 tokens; past Gemma 4's window of 16 several times over
FAMILIES = ["qwen3_moe", "qwen3_5_moe", "gemma4"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Factory: name -> (transformers reference or None, checkpoint path)."""
    root = tmp_path_factory.mktemp("logits-stretch")
    made = {"qwen3_5_moe": (None, HYBRID)}
    qwen3 = build_reference(tiny_config("qwen3_moe", experts=8, top_k=2, layers=2, dense=True))
    made["qwen3_moe"] = (qwen3, save_checkpoint(qwen3, root / "qwen3_moe"))
    gemma4 = build(seed=1)
    made["gemma4"] = (gemma4, save_checkpoint(gemma4, root / "gemma4", fused=True))
    return made.__getitem__


def ids_of(n: int, vocab: int, seed: int = 5) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def record_forwards(model) -> list[tuple[int, int]]:
    """(tokens, micro-batch) of every forward of `model` from here on."""
    calls = []
    forward = model.net.forward

    def spy(tokens, kv, *args, **kwargs):
        T = tokens.shape[0]
        chunk = kwargs.get("chunk", args[1] if len(args) > 1 else None)
        calls.append((T, T if chunk is None else min(chunk, T)))
        return forward(tokens, kv, *args, **kwargs)

    model.net.forward = spy
    return calls


@pytest.mark.parametrize("name", FAMILIES)
def test_no_forward_runs_over_more_than_a_stretch(family, name):
    model = expertcache.load(family(name)[1], dtype="float32", prefill_stretch=STRETCH)
    ids = ids_of(N, model.cfg.vocab_size)
    calls = record_forwards(model)
    out = model.logits(ids)
    assert out.shape == (N, model.cfg.vocab_size)
    assert [t for t, _ in calls] == [40, 40, 40, 30], calls
    assert (model.last_prefill.tokens, model.last_prefill.stretches) == (N, 4)
    calls.clear()
    assert torch.equal(model.logits(ids, ubatch=16), model.logits(ids, ubatch=16))
    assert calls == 2 * [(40, 16), (40, 16), (40, 16), (30, 16)], calls


def test_prefill_mem_bounds_the_stretch_of_logits(family, monkeypatch):
    """The budget the user sets (--prefill-mem), not only --prefill-stretch: a stretch cut to it
    is the most tokens any forward of logits() runs, and attention sees at most a micro-batch."""
    path = family("qwen3_moe")[1]
    per_token = expertcache.load(path, dtype="float32").net.activation_bytes(1)
    model = expertcache.load(path, dtype="float32", prefill_mem=32 * per_token)
    assert model.stretch == 32
    ids = ids_of(N, model.cfg.vocab_size)
    calls, queries = record_forwards(model), attention_calls(monkeypatch)
    model.logits(ids)
    assert max(t for t, _ in calls) == 32 and sum(t for t, _ in calls) == N, calls
    assert queries and max(q for _, _, q in queries) == 32, queries
    queries.clear()
    model.logits(ids, ubatch=8)
    assert queries and max(q for _, _, q in queries) == 8, queries


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("ubatch", [None, 16])  # None: logits' default, prefill's (512)
def test_logits_are_bitwise_prefill_on_a_new_session(family, name, ubatch):
    ref, path = family(name)
    model = expertcache.load(path, dtype="float32", prefill_stretch=STRETCH)
    ids = ids_of(N, model.cfg.vocab_size)
    given = {} if ubatch is None else {"ubatch": ubatch}
    got = model.logits(ids, **given)
    assert torch.equal(got, model.prefill(model.new_session(), ids, all_logits=True, **given))
    # Against one forward over all the tokens (the logits before stretches) and transformers:
    # within the parity tests' tolerance, the split sums rounding otherwise.
    torch.testing.assert_close(got, one_forward(model, ids), rtol=0, atol=1e-4)
    if ref is not None:
        torch.testing.assert_close(got, ref_logits(ref, torch.tensor(ids)), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_up_to_a_micro_batch_logits_are_one_forward_bit_for_bit(family, name):
    model = expertcache.load(family(name)[1], dtype="float32", prefill_stretch=STRETCH)
    for n in (1, 7, STRETCH):  # Gemma 4: a ring shorter than its window, then wrapped
        ids = ids_of(n, model.cfg.vocab_size, seed=n)
        assert torch.equal(model.logits(ids), one_forward(model, ids)), n


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_keep_no_state(family, name):
    model = expertcache.load(family(name)[1], dtype="float32", prefill_stretch=STRETCH)
    ids = ids_of(N, model.cfg.vocab_size)
    follow = ids_of(2 * WINDOW, model.cfg.vocab_size, seed=9)
    session = model.new_session()
    model.prefill(session, ids[:50], ubatch=16)
    before = session.copy()
    snapshots = [s.position for s in session.kv.snapshots]
    first = model.logits(ids)
    second = model.logits(ids)
    assert torch.equal(first, second)
    # The session from before is as it was: same tokens, length and snapshots, and it goes on
    # to the bits a copy taken before the calls goes on to.
    assert session.tokens == before.tokens == ids[:50] and session.kv.length == 50
    assert [s.position for s in session.kv.snapshots] == snapshots
    assert torch.equal(model.prefill(session, follow, ubatch=16, all_logits=True),
                       model.prefill(before, follow, ubatch=16, all_logits=True))


def test_logits_keep_their_checks(family):
    model = expertcache.load(family("qwen3_moe")[1], dtype="float32", ctx_size=64, prefill_stretch=16)
    ran = model.telemetry()["total"]["ops_seen"]
    for ids, needle in (([], "nothing to process: no token ids"),
                        ([3, model.cfg.vocab_size], f"token id {model.cfg.vocab_size} out of range"),
                        ([-1, 3], "token id -1 out of range"),
                        (list(range(4, 69)), "65 tokens do not fit the context of 64 tokens"),
                        ("hello", "token ids must be a list of integers")):
        with pytest.raises(ExpertCacheError, match=needle):
            model.logits(ids)
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ExpertCacheError, match="ubatch"):
            model.logits([5, 6], ubatch=bad)
    assert model.telemetry()["total"]["ops_seen"] == ran  # refused before any forward
    assert model.logits(list(range(4, 68))).shape == (64, model.cfg.vocab_size)  # the whole context fits
