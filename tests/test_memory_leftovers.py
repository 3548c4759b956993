"""Peak memory of the keys and values as they grow, and of a prefill stretch that returns the
logits of every token (docs/prefill.md, "Memory"), counted tensor by tensor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import expertcache
from conftest import build_reference, save_checkpoint, tiny_config
from expertcache.models.layers import KVCache
from test_gemma4 import build
from test_stretch_audit import LiveBytes, ids_of, stretch_peak

# A vocabulary as much wider than the hidden size as real models' (Qwen3-30B-A3B: 151,936 / 2,048;
# Gemma 4: 262,144 / 2,816), so that a stretch's logits outweigh its activations as they do there.
VOCAB = 8192


def _kv_bytes(kv: KVCache) -> int:
    return sum(t.nbytes for d in (kv.k, kv.v) for t in d.values())


def test_growing_the_keys_and_values_holds_one_old_buffer_beyond_the_new_ones():
    """Regrowth copies the kept rows into larger buffers one at a time: at most the new buffers
    plus one old one are live at once (allocating every new buffer first held old + new), and
    every kept row and every layer's own shape come through."""
    cfg = SimpleNamespace(num_kv_heads=2, head_dim=8, num_layers=6)
    shapes = {4: (1, 32)}  # a layer whose heads differ from the config's (Gemma 4's full layers)
    kv = KVCache(cfg, 100_000, torch.device("cpu"), torch.float32, layers=[0, 1, 2, 4, 5], shapes=shapes)
    meter = LiveBytes(set())
    with meter:
        kv.reserve(1000)
    for i in kv.layers:
        G, Dh = shapes.get(i, (2, 8))
        kv.k[i][:, :1000] = torch.arange(G * 1000 * Dh, dtype=torch.float32).view(G, 1000, Dh) + i
        kv.v[i][:, :1000] = -kv.k[i][:, :1000]
    kv.advance(1000)
    want = {i: (kv.k[i][:, :1000].clone(), kv.v[i][:, :1000].clone()) for i in kv.layers}  # uncounted
    old_largest = max(t.nbytes for d in (kv.k, kv.v) for t in d.values())
    with meter:
        meter.counting = True
        kv.reserve(1001)
        torch.empty(0)  # an op after the last buffer is replaced: the meter drops the old one
    assert kv.capacity >= 1001
    assert meter.peak <= _kv_bytes(kv) + old_largest, (meter.peak, _kv_bytes(kv), old_largest)
    for i in kv.layers:
        G, Dh = shapes.get(i, (2, 8))
        assert kv.k[i].shape == kv.v[i].shape == (G, kv.capacity, Dh)
        assert torch.equal(kv.k[i][:, :1000], want[i][0]) and torch.equal(kv.v[i][:, :1000], want[i][1])


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Checkpoints with a wide vocabulary: Qwen3-MoE (with a dense layer), and Gemma 4, whose
    logits are soft-capped."""
    root = tmp_path_factory.mktemp("memory-leftovers")
    qwen = tiny_config("qwen3_moe", experts=8, top_k=2, layers=2, dense=True)
    qwen.vocab_size = VOCAB
    return {"qwen3_moe": save_checkpoint(build_reference(qwen), root / "qwen3_moe"),
            "gemma4": save_checkpoint(build(seed=1, vocab_size=VOCAB), root / "gemma4", fused=True)}


def test_keys_and_values_grow_by_a_quarter_after_a_prompt_and_give_the_same_bits(wide):
    """A prompt reserves its length exactly; decoding after it grows the buffers by a quarter,
    not to twice the prompt (a 300-token prompt and 400 steps ended at 1,200 rows for 700
    tokens), in amortised steps (rows copied at most 4 per token). The logits are bitwise those
    of a session whose buffers hold the whole context from the start."""
    model = expertcache.load(wide["qwen3_moe"], dtype="bfloat16", ctx_size=4096)
    ids = ids_of(700, seed=3, vocab=VOCAB)
    outs, caps = [], []
    for up_front in (False, True):
        s = model.new_session()
        if up_front:
            s.kv.reserve(model.ctx_size)
        copied = [0]
        reserve = s.kv.reserve

        def counting(n, kv=s.kv, reserve=reserve, copied=copied):
            if n > kv.capacity:
                copied[0] += kv.length
            reserve(n)
        s.kv.reserve = counting
        got = [model.prefill(s, ids[:300], ubatch=64, all_logits=True)]
        assert s.kv.capacity == (model.ctx_size if up_front else 300)
        got += [model.prefill(s, [t], all_logits=True) for t in ids[300:]]
        outs.append(torch.cat(got))
        caps.append(s.kv.capacity)
        assert copied[0] <= 4 * len(ids)
    assert 700 <= caps[0] <= 700 * 5 // 4, caps[0]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4"])
def test_a_prompt_in_several_stretches_reserves_its_keys_and_values_once(wide, family):
    """A prompt of four stretches takes its whole length of keys and values before the first
    stretch runs, and no stretch copies them into a larger buffer (grown stretch by stretch, each
    stretch copied every earlier position); the logits are bitwise those of the same prefill with
    the buffers grown as it goes (a session that reserved its context up front does not grow)."""
    model = expertcache.load(wide[family], dtype="bfloat16", ctx_size=1024, prefill_stretch=128)
    ids = ids_of(512, seed=4, vocab=VOCAB)
    outs = []
    for up_front in (False, True):
        s = model.new_session()
        if up_front:
            s.kv.reserve(model.ctx_size)
        grown = []
        reserve = s.kv.reserve

        def counting(n, kv=s.kv, reserve=reserve, grown=grown):
            if n > kv.capacity:
                grown.append((kv.length, n))
            reserve(n)
        s.kv.reserve = counting
        outs.append(model.prefill(s, ids, ubatch=64, all_logits=True))
        assert model.last_prefill.stretches == 4
        assert grown == ([] if up_front else [(0, 512)]), grown
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4"])
def test_a_stretch_returning_all_logits_takes_prefill_mem_plus_the_logits(wide, family, dtype):
    """With all logits asked for, a prompt runs in the stretch planned for `--prefill-mem` M,
    and the call takes at most M, the logits of its tokens [N, V] (the caller's result, which
    grows with the prompt whatever the stretch; docs/prefill.md) and one stretch's logits [S, V],
    which the forward makes before they are copied into the result. The stretches' logits joined
    at the end took twice [N, V]; Gemma 4's soft-capping took three times a stretch's logits."""
    per_token = expertcache.load(wide[family], dtype=dtype, kernels="torch").net.activation_bytes(1)
    tokens = 48
    model = expertcache.load(wide[family], dtype=dtype, kernels="torch", prefill_mem=tokens * per_token)
    assert model.stretch == tokens
    ids = ids_of(3 * tokens + 5, seed=5, vocab=VOCAB)
    item = torch.empty((), dtype=model.net.dtype).element_size()
    logits, stretch_logits = len(ids) * VOCAB * item, tokens * VOCAB * item
    used = stretch_peak(model, ids, ubatch=16, all_logits=True)
    assert model.last_prefill.stretches == 4
    assert used <= tokens * per_token + logits + stretch_logits, (used, tokens * per_token, logits, stretch_logits)


def test_a_prompt_in_one_stretch_returns_its_logits_without_a_copy(wide):
    """Perplexity asks for the logits of one stretch per call: [tokens, vocabulary], 2.3 GiB for
    4096 tokens of Qwen3's vocabulary in fp32. The call returns the forward's own tensor; several
    stretches' logits are joined into one (a copy)."""
    model = expertcache.load(wide["qwen3_moe"], dtype="float32", kernels="torch")
    made = []
    forward = model.net.forward
    model.net.forward = lambda *a, **k: made.append(forward(*a, **k)) or made[-1]
    out = model.prefill(model.new_session(), ids_of(40, seed=1, vocab=VOCAB), all_logits=True)
    assert len(made) == 1 and out.data_ptr() == made[0].data_ptr()
    model.stretch = 16
    out = model.prefill(model.new_session(), ids_of(40, seed=1, vocab=VOCAB), all_logits=True)
    assert len(made) == 4 and torch.equal(out, torch.cat(made[1:]))
