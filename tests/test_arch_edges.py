"""Gemma 4 and Qwen3.5-MoE at their edges: RoPE variants transformers accepts, and the memory a
long prefill in many micro-batches holds for snapshots of state that cannot be cut back."""

from __future__ import annotations

import weakref

import pytest
import torch

import expertcache
from expertcache.models.deltanet import DeltaNetState
from expertcache.models.window_cache import Ring
from test_gemma4 import gemma4, ref_logits  # noqa: F401  (gemma4: a fixture)
from test_parity import ids_of
from test_qwen35 import qwen35  # noqa: F401  (a fixture)

S, F = "sliding_attention", "full_attention"


def test_full_layers_with_default_rope_rotate_the_whole_head(gemma4):  # noqa: F811
    """transformers' default RoPE for Gemma 4 reads no partial_rotary_factor: a config that gives
    one beside `rope_type: default` still rotates every dim of the full layers' heads."""
    rope = {F: {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
            S: {"rope_type": "default", "rope_theta": 1e4}}
    ref, d = gemma4(seed=21, rope_parameters=rope)
    model = expertcache.load(d)
    ids = ids_of(40, seed=22)
    torch.testing.assert_close(model.logits(ids), ref_logits(ref, ids), atol=1e-4, rtol=0)
    assert all(lw.mixer.cfg.rotary_factor == 1.0 for lw in model.net.weights.layers)
    # the proportional form still rotates only its share
    rope[F]["rope_type"] = "proportional"
    ref, d = gemma4(seed=21, rope_parameters=rope)
    model = expertcache.load(d)
    assert {lw.mixer.cfg.rotary_factor for lw in model.net.weights.layers if lw.mixer.kind == F} == {0.25}
    torch.testing.assert_close(model.logits(ids), ref_logits(ref, ids), atol=1e-4, rtol=0)


def live_state_copies(monkeypatch, cls, field: str) -> list:
    """Weak references to the tensor `field` of every `cls.copy()` made from now on: the copies
    still alive are the ones whose reference is."""
    made = []
    orig = cls.copy

    def copy(self):
        out = orig(self)
        made.append(weakref.ref(getattr(out, field)))
        return out

    monkeypatch.setattr(cls, "copy", copy)
    return made


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "gemma4"])
def test_a_prefill_in_many_micro_batches_holds_no_more_copies_than_it_keeps(arch, gemma4, qwen35,  # noqa: F811
                                                                             monkeypatch):
    """A stretch of many micro-batches copies each layer's state at every micro-batch end, but
    only the last max_snapshots - 1 of them can be kept (the stretch's end is one more): the
    copies alive at any point stay within max_snapshots per layer, however many micro-batches
    there are, and the snapshots kept restore a fresh run's logits."""
    _, d = gemma4(seed=23) if arch == "gemma4" else qwen35(seed=23)
    model = expertcache.load(d)
    keep, first, ubatch, n = 3, 10, 5, 120
    model.net.max_snapshots = keep
    ids = ids_of(first + n + 20, seed=24).tolist()
    s = model.new_session()
    model.prefill(s, ids[:first])
    held = s.kv.recurrent if arch == "qwen3_5_moe" else s.kv.rings
    cls, field = (DeltaNetState, "recurrent") if arch == "qwen3_5_moe" else (Ring, "k")
    made = live_state_copies(monkeypatch, cls, field)
    peak = [0]
    layer_done = s.kv.layer_done

    def counting(layer, position):
        layer_done(layer, position)
        peak[0] = max(peak[0], sum(r() is not None for r in made))

    s.kv.layer_done = counting
    model.prefill(s, ids[first:first + n], ubatch=ubatch)
    del s.kv.layer_done
    ends = list(range(first + ubatch, first + n, ubatch)) + [first + n]
    assert [snap.position for snap in s.kv.snapshots] == ends[-keep:]
    # the start of the stretch (kept until its end) and at most keep - 1 micro-batch ends
    assert 0 < peak[0] <= keep * len(held), (peak[0], len(held))
    fresh = model.logits(ids)
    for cut in (first + n - 1, ends[-keep] + 2, ends[-keep]):
        c = s.copy()
        kept = c.truncate(cut)
        assert kept in ends[-keep:] or kept == cut, (cut, kept)
        torch.testing.assert_close(model.prefill(c, ids[kept:], all_logits=True), fresh[kept:], atol=1e-4,
                                   rtol=0)
