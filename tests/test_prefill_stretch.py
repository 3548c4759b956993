"""Long prompts in stretches: each layer's mixer over micro-batches, its MoE op over the whole
stretch, so that each expert is read from the slow tier once per stretch. Checked against the
one-forward logits (fp32), across cache modes (bitwise), and by the bytes the slow tier gave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import expertcache
from conftest import assert_one_line_error, run_cli
from expertcache.config import CacheConfig
from expertcache.engine import plan_stretch
from expertcache.errors import ExpertCacheError
from test_gemma4 import WINDOW, gemma4  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "tests" / "fixtures" / "gguf" / "qwen3_5_moe" / "qwen3_5_moe-F32.gguf"


def ids_of(n: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def stretch_logits(model, ids: list[int], ubatch: int) -> torch.Tensor:
    return model.prefill(model.new_session(), ids, ubatch=ubatch, all_logits=True)


def one_forward(model, ids: list[int]) -> torch.Tensor:
    """The reference: one forward over all of `ids` (`Model.logits` runs them in stretches too)."""
    return model.net.forward(torch.tensor(ids, dtype=torch.long), model.net.new_kv(len(ids)))


def test_a_stretch_equals_one_forward_on_the_bundled_model():
    model = expertcache.load(dtype="float32", prefill_stretch=96)
    ids = ids_of(200, seed=1, vocab=model.cfg.vocab_size).tolist()
    got = stretch_logits(model, ids, ubatch=20)   # stretches of 96, micro-batches of 20 inside
    want = one_forward(model, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_stretch_equals_one_forward_with_recurrent_layers():
    model = expertcache.load(HYBRID, prefill_stretch=64)
    ids = ids_of(150, seed=2, vocab=model.cfg.vocab_size).tolist()
    torch.testing.assert_close(stretch_logits(model, ids, ubatch=24), one_forward(model, ids), rtol=0, atol=1e-4)


def test_recurrent_snapshots_at_micro_batch_ends_inside_a_stretch_restore_exactly():
    model = expertcache.load(HYBRID, prefill_stretch=64)
    ids = ids_of(170, seed=2, vocab=model.cfg.vocab_size).tolist()
    s = model.new_session()
    model.prefill(s, ids[:150], ubatch=24)
    # Stretches [0, 64), [64, 128), [128, 150): micro-batch ends 24, 48 | 88, 112 inside them.
    assert [snap.position for snap in s.kv.snapshots] == [24, 48, 64, 88, 112, 128, 150]
    fresh = one_forward(model, ids)
    for n, kept in ((100, 88), (50, 48), (20, 0)):
        c = s.copy()
        assert c.kv.truncate(n) == kept
        del c.tokens[kept:]
        torch.testing.assert_close(model.prefill(c, ids[kept:], ubatch=24, all_logits=True), fresh[kept:],
                                   rtol=0, atol=1e-4)


def test_a_stretch_equals_one_forward_across_the_sliding_window(gemma4):
    _, d = gemma4(seed=3)
    model = expertcache.load(d, prefill_stretch=40)
    ids = ids_of(5 * WINDOW + 3, seed=3).tolist()
    torch.testing.assert_close(stretch_logits(model, ids, ubatch=WINDOW // 2 + 1), one_forward(model, ids),
                               rtol=0, atol=1e-4)


CACHES = [CacheConfig(mode="cache", fraction=0.25, store="disk"),
          CacheConfig(mode="cache", experts=3, policy="lru", store="mmap"),
          CacheConfig(mode="cache", fraction=0.5, policy="s3fifo"),
          CacheConfig(mode="staging", experts=2, store="disk")]


def test_results_never_depend_on_the_cache_and_the_session_continues_mid_stretch():
    ids = ids_of(300, seed=4, vocab=expertcache.load().cfg.vocab_size).tolist()

    def run(cache):
        model = expertcache.load(cache=cache, prefill_stretch=128)
        s = model.new_session()
        out = [model.prefill(s, ids[:170], ubatch=50, all_logits=True)]  # a stretch ends at 128, one at 170
        out.append(model.prefill(s, ids[170:], ubatch=50, all_logits=True))
        return torch.cat(out)

    want = run(CacheConfig(mode="resident"))
    for cache in CACHES:
        assert torch.equal(run(cache), want), cache


def _cold_bytes(stretch: int, ids: list[int]) -> tuple[int, int, expertcache.engine.PrefillStats]:
    model = expertcache.load(cache=CacheConfig(mode="cache", fraction=0.25, store="disk"),
                             prefill_stretch=stretch)
    model.prefill(model.new_session(), ids, ubatch=64)
    tel = model.telemetry()
    return tel["total"]["used_experts_unique"] * tel["expert_bytes"], tel["total"]["copied_bytes"], model.last_prefill


def test_each_expert_is_read_once_per_stretch():
    model = expertcache.load()
    ids = ids_of(1024, seed=5, vocab=model.cfg.vocab_size).tolist()
    all_bytes = sum(model.experts.expert_bytes[i] * model.cfg.num_experts for i in model.cfg.moe_layers)
    used, copied, stats = _cold_bytes(4096, ids)
    # One stretch: one op per MoE layer, every expert it uses copied exactly once (25% of the
    # experts fit, so none could stay from an earlier op).
    assert stats.stretches == 1 and stats.tokens == 1024
    assert copied == used == stats.bytes_read
    assert copied <= all_bytes
    assert stats.bytes_per_token == copied / 1024
    # Micro-batch by micro-batch, the same prompt reads the experts again for each.
    _, copied_small, small = _cold_bytes(64, ids)
    assert small.stretches == 16
    assert copied_small > 8 * copied


def test_a_stretch_over_the_memory_allowed_is_cut_with_one_notice(capsys):
    assert plan_stretch(1000, 4096, 10**7) == 4096
    assert capsys.readouterr().err == ""
    assert plan_stretch(1000, 4096, 10**6) == 1000
    # Below one token's activations no stretch keeps to the budget: refused, not run over it.
    with pytest.raises(ExpertCacheError, match="less than one token's activations"):
        plan_stretch(1000, 4096, 999)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cut from 4096 to 1000 tokens" in err and "--prefill-mem" in err
    model = expertcache.load(prefill_mem=20 * expertcache.load().net.activation_bytes(1))
    assert model.stretch == 20
    ids = ids_of(70, seed=6, vocab=model.cfg.vocab_size).tolist()
    explicit = expertcache.load(prefill_stretch=20)
    assert torch.equal(stretch_logits(model, ids, 8), stretch_logits(explicit, ids, 8))


def test_activations_are_allocated_once():
    model = expertcache.load(prefill_stretch=256)
    ids = ids_of(600, seed=7, vocab=model.cfg.vocab_size).tolist()
    model.prefill(model.new_session(), ids, ubatch=64)
    buffers = {n: b.data_ptr() for n, b in model.net.workspace.buffers.items()}
    assert set(buffers) == {"xs", "ys", "out"}
    A, D = model.cfg.top_k, model.cfg.hidden_size
    assert model.net.workspace.nbytes == 3 * 256 * A * D * 2  # bf16
    assert model.net.workspace.nbytes <= model.net.activation_bytes(256)
    model.prefill(model.new_session(), ids[:300], ubatch=64)
    assert {n: b.data_ptr() for n, b in model.net.workspace.buffers.items()} == buffers


def test_a_failed_read_mid_stretch_leaves_the_session_where_it_was():
    model = expertcache.load(cache=CacheConfig(mode="cache", fraction=0.25, store="disk"), prefill_stretch=128)
    ids = ids_of(200, seed=8, vocab=model.cfg.vocab_size).tolist()
    s = model.new_session()
    model.prefill(s, ids[:100], ubatch=32)

    start = model.experts.store.reads

    def fail(n):  # from the third read on: a copy that failed on the worker fails again when remade
        if n >= start + 3:
            raise OSError("injected")

    model.experts.store.read_hook = fail
    with pytest.raises(OSError, match="injected"):
        model.prefill(s, ids[100:], ubatch=32)
    model.experts.store.read_hook = None
    assert s.kv.length == 100 and len(s.tokens) == 100
    got = model.prefill(s, ids[100:], ubatch=32, all_logits=True)
    fresh = expertcache.load(prefill_stretch=128)
    f = fresh.new_session()
    fresh.prefill(f, ids[:100], ubatch=32)
    assert torch.equal(got, fresh.prefill(f, ids[100:], ubatch=32, all_logits=True))


@pytest.mark.parametrize("path", [None, HYBRID], ids=["kv", "recurrent"])
def test_a_prefill_stopped_inside_a_stretch_leaves_a_session_that_continues_exactly(path):
    model = expertcache.load(path, prefill_stretch=128)
    ids = ids_of(200, seed=9, vocab=model.cfg.vocab_size).tolist()
    s = model.new_session()
    model.prefill(s, ids[:90], ubatch=30)
    asked = []

    def stop():
        asked.append(1)
        return len(asked) == 5  # inside the next stretch, in its second layer

    assert model.prefill(s, ids[90:], ubatch=30, should_stop=stop) is None
    assert len(s.tokens) == s.kv.length == 90
    # As after a failed forward: the state is cut back to what the session holds, then runs on.
    kept = s.truncate(90)
    got = model.prefill(s, ids[kept:], ubatch=30, all_logits=True)[90 - kept:]
    fresh = model.new_session()
    model.prefill(fresh, ids[:90], ubatch=30)
    assert torch.equal(got, model.prefill(fresh, ids[90:], ubatch=30, all_logits=True))


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_bad_stretch_flags_are_one_line_errors(capsys, value):
    code, err = run_cli(capsys, "run", "-p", "hello", "-n", "1", "--prefill-stretch", value)
    assert_one_line_error(code, err, "--prefill-stretch", value)


def test_bad_stretch_arguments_are_errors():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ExpertCacheError, match="prefill-stretch"):
            expertcache.load(prefill_stretch=bad)
    with pytest.raises(ExpertCacheError, match="prefill-mem"):
        expertcache.load(prefill_mem=0)


def test_bench_serve_starts_our_server_with_the_prefill_and_prefetch_flags():
    from expertcache.bench import serve
    from expertcache.commands.serve import register
    from expertcache.flags import Parser

    p = Parser(prog="bench")
    serve.add_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--suite", "prefill", "-m", "M", "--compare", "resident,cache",
                         "--prefill-stretch", "1024", "--prefill-mem", "1GiB", "--prefetch", "on",
                         "--prefetch-width", "1.5", "--prefetch-min-prob", "0.55", "--cache-fraction", "0.25",
                         "--activations", "q8"])
    argv = serve.serve_argv(args, "cache", 8080)
    # what the server parses from that command line
    server = Parser(prog="expertcache")
    register(server.add_subparsers())
    got = server.parse_args(argv[argv.index("serve"):])
    assert (got.prefill_stretch, got.prefill_mem, got.prefetch, got.prefetch_width, got.prefetch_min_prob,
            got.cache_fraction, got.activations) == (1024, 2**30, "on", 1.5, 0.55, 0.25, "q8")
    resident = server.parse_args(serve.serve_argv(args, "resident", 8080)[3:])
    assert resident.prefill_stretch == 1024 and resident.cache_fraction is None


def test_bench_serve_passes_every_flag_it_shares_with_serve():
    """Each option both `bench serve` and `serve` take, given a value other than its default,
    reaches the server `bench serve --compare` starts (--cache-verify and --predictor were
    accepted and dropped); options only one side has are listed here and nowhere else."""
    from expertcache.bench import serve
    from expertcache.commands.serve import register
    from expertcache.flags import Parser

    bench, server = Parser(prog="bench"), Parser(prog="expertcache")
    serve.add_parser(bench.add_subparsers())
    register(server.add_subparsers())
    ours = {a.dest: a for a in bench._subparsers._group_actions[0].choices["serve"]._actions}
    theirs = {a.dest: a for a in server._subparsers._group_actions[0].choices["serve"]._actions}
    # set by bench serve itself (mode, loopback address), or naming the model differently
    own = {"help", "cache_mode", "host", "port", "model"}
    shared = sorted(set(ours) & set(theirs) - own)
    values = {"threads": "3", "ctx_size": "512", "dtype": "float32", "device": "cpu", "ubatch": "64",
              "prefill_stretch": "1024", "prefill_mem": "1GiB", "kernels": "torch", "activations": "exact",
              "cache_policy": "lru", "store": "disk", "cache_fraction": "0.25", "prefetch": "on",
              "prefetch_width": "1.5", "prefetch_min_prob": "0.5", "predictor": "p.safetensors"}
    argv = ["serve", "--suite", "prefill", "-m", "M", "--compare", "cache"]
    for dest in shared:
        action = ours[dest]
        if action.nargs == 0:  # a switch
            argv.append(action.option_strings[-1])
        elif dest in values:
            argv += [action.option_strings[-1], values[dest]]
    args = bench.parse_args(argv)
    got = server.parse_args(serve.serve_argv(args, "cache", 8080)[3:])
    missing = [d for d in shared if d not in ("cache_experts", "cache_mem") and getattr(got, d) != getattr(args, d)]
    assert not missing, missing
    assert got.cache_verify and got.predictor == "p.safetensors"


def test_bench_cache_passes_the_kernel_and_activation_choices_to_each_run():
    from expertcache.bench import cache_bench
    from expertcache.flags import Parser

    p = Parser(prog="bench")
    cache_bench.add_parser(p.add_subparsers())
    args = p.parse_args(["cache", "-m", "M", "--stores", "ram", "--fractions", "0.5", "--activations", "exact",
                         "--kernels", "native"])
    specs = cache_bench.configurations(args)
    assert specs and all(s["activations"] == "exact" and s["kernels"] == "native" for s in specs)
