"""Long prompts in stretches, audited: the activations a stretch really allocates against what
`--prefill-mem` is told they take (measured tensor by tensor), and results across stretch and
micro-batch sizes, cache modes, stores, a reused prefix and a stop part-way (docs/prefill.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import expertcache
from expertcache.config import CacheConfig
from test_gemma4 import gemma4  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "tests" / "fixtures" / "gguf" / "qwen3_5_moe" / "qwen3_5_moe-F32.gguf"


def ids_of(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors that ops allocate while it is on, and their peak while `counting`
    (a storage is counted once, from the op that made it, until it is freed; views are free)."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.exclude, self.now, self.peak, self.counting = exclude, 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in self.live and key not in self.exclude and key not in inputs:
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
                    self.now += st.nbytes()
        if self.counting:
            self.peak = max(self.peak, self.now)
        return out


class _Uncounted:
    """A layer's mixer, run with the count paused: its buffers are bounded by the micro-batch and
    the context, which `--prefill-mem` does not cover (docs/prefill.md, "Memory")."""

    def __init__(self, mixer, meter: LiveBytes):
        self.mixer, self.meter = mixer, meter

    def __getattr__(self, name):
        return getattr(self.mixer, name)

    def __call__(self, *args, **kwargs):
        self.meter.counting = False
        return self.mixer(*args, **kwargs)


def stretch_peak(model, ids: list[int], ubatch: int, all_logits: bool = False) -> int:
    """Peak bytes of a one-stretch prefill's activations outside the mixers: every tensor the
    forward allocates and holds while the feed-forward blocks run, plus the MoE workspace. With
    `all_logits`, a prefill that returns every token's logits, counted up to its return: its
    stretches' logits and the [N, V] result count too."""
    net = model.net
    model.prefill(model.new_session(), ids, ubatch=ubatch)  # the workspace, allocated once
    s = model.new_session()
    s.kv.reserve(len(ids))                 # the keys and values are the context's, not the stretch's
    s.kv.layer_done = lambda *args: None   # recurrent snapshots are state, not activations
    meter = LiveBytes({b.untyped_storage().data_ptr() for b in net.workspace.buffers.values()})
    mixers = [lw.mixer for lw in net.weights.layers]
    for lw in net.weights.layers:
        lw.mixer = _Uncounted(lw.mixer, meter)
    net.residual_hook = lambda layer, h: setattr(meter, "counting", True)
    try:
        with meter:
            if all_logits:
                model.prefill(s, ids, ubatch=ubatch, all_logits=True)
            else:
                # The count stops as the last layer is done: the last token's logits and the
                # snapshot the forward ends with are the session's, whatever the stretch.
                model.prefill(s, ids, ubatch=ubatch, progress=lambda done, total: done < total or
                              setattr(meter, "counting", False))
    finally:
        for lw, mixer in zip(net.weights.layers, mixers):
            lw.mixer = mixer
        net.residual_hook = None
    return meter.peak + net.workspace.nbytes


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Checkpoints of each kind of feed-forward block: routed experts (Qwen3-MoE, with a dense
    layer), a shared expert beside them (Qwen2-MoE), a dense MLP beside them (Gemma 4, from
    test_gemma4), and a hybrid with recurrent layers (Qwen3.5-MoE)."""
    from conftest import build_reference, save_checkpoint, tiny_config
    from test_gemma4 import build

    root = tmp_path_factory.mktemp("stretch-audit")
    out = {"qwen3_5_moe": HYBRID}
    for arch, opts in (("qwen3_moe", dict(dense=True)), ("qwen2_moe", {})):
        out[arch] = save_checkpoint(build_reference(tiny_config(arch, experts=8, top_k=2, layers=2, **opts)),
                                    root / arch)
    out["gemma4"] = save_checkpoint(build(seed=1), root / "gemma4", fused=True)
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gemma4", "qwen3_5_moe"])
def test_a_stretch_cut_to_prefill_mem_allocates_no_more(families, family, dtype):
    """`--prefill-mem` bounds what a stretch's activations take: a stretch planned for M bytes
    allocates at most M outside the mixers, measured tensor by tensor."""
    probe = expertcache.load(families[family], dtype=dtype, kernels="torch")
    per_token = probe.net.activation_bytes(1)
    for tokens in (24, 96):
        model = expertcache.load(families[family], dtype=dtype, kernels="torch",
                                 prefill_mem=tokens * per_token)
        assert model.stretch == tokens
        ids = ids_of(tokens, seed=tokens, vocab=model.cfg.vocab_size)
        used = stretch_peak(model, ids, ubatch=16)
        assert used <= tokens * per_token, (family, dtype, tokens, used, tokens * per_token)


UBATCH, PROMPT = 8, 40
STRETCHES = [1, 2, UBATCH - 1, UBATCH, UBATCH + 1, PROMPT, PROMPT + 5]
CACHES = [CacheConfig(mode="cache", experts=3, policy="lru", store="disk"),
          CacheConfig(mode="cache", fraction=0.5, store="mmap"),
          CacheConfig(mode="staging", experts=2, store="ram")]


def _prefix_then_rest(model, ids: list[int]) -> torch.Tensor:
    """The first 17 tokens, then the rest of the prompt in the same session, which holds them: all
    logits of the second call."""
    s = model.new_session()
    model.prefill(s, ids[:17], ubatch=UBATCH)
    return model.prefill(s, ids[17:], ubatch=UBATCH, all_logits=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4", "qwen3_5_moe"])
def test_every_stretch_size_gives_the_same_logits_in_every_cache_mode(families, family):
    """At each stretch size (one token, a micro-batch and either side of it, the prompt, beyond
    it), the logits of a session that reuses a prefix are bitwise those of the all-resident
    model, in every cache mode and store, and within 1e-4 of one forward over the prompt (fp32)."""
    path = families[family]
    ids = ids_of(PROMPT, seed=11, vocab=expertcache.load(path).cfg.vocab_size)
    one_forward = expertcache.load(path, dtype="float32").logits(ids)[17:]
    for stretch in STRETCHES:
        want = _prefix_then_rest(expertcache.load(path, dtype="float32", prefill_stretch=stretch), ids)
        torch.testing.assert_close(want, one_forward, rtol=0, atol=1e-4)
        for cache in CACHES:
            got = _prefix_then_rest(expertcache.load(path, dtype="float32", cache=cache, prefill_stretch=stretch), ids)
            assert torch.equal(got, want), (stretch, cache)


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4", "qwen3_5_moe"])
def test_a_prefill_stopped_part_way_continues_as_a_fresh_run(families, family):
    """Stopped at the third question (between stretches or inside one), the session holds whole
    stretches; cut back to what it can restore and run on, it gives one forward's logits
    (fp32, 1e-4), bitwise the same in a cache on the disk store as all-resident."""
    path = families[family]
    ids = ids_of(PROMPT, seed=12, vocab=expertcache.load(path).cfg.vocab_size)
    one_forward = expertcache.load(path, dtype="float32").logits(ids)
    for stretch in (1, UBATCH + 1, PROMPT):
        runs = []
        for cache in (CacheConfig(mode="resident"), CACHES[0]):
            model = expertcache.load(path, dtype="float32", cache=cache, prefill_stretch=stretch)
            s = model.new_session()
            model.prefill(s, ids[:17], ubatch=UBATCH)
            asked = []
            assert model.prefill(s, ids[17:], ubatch=UBATCH, should_stop=lambda: len(asked) > 2 or asked.append(1)) is None
            assert len(s.tokens) == s.kv.length and s.tokens == ids[:len(s.tokens)]
            kept = s.truncate(len(s.tokens))
            runs.append(model.prefill(s, ids[kept:], ubatch=UBATCH, all_logits=True))
            torch.testing.assert_close(runs[-1], one_forward[kept:], rtol=0, atol=1e-4)
        assert torch.equal(runs[0], runs[1]), stretch
