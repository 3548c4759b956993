"""Bit-exactness and cache benchmark on a GPU, from the source tree, with only the core libraries
(torch, numpy, safetensors, tokenizers, jinja2, tqdm, gguf): no pytest, no transformers.

    PYTHONPATH=src python3 scripts/gpu_check.py [--device cuda] [--skip-bench]

1. On a small random checkpoint (fp32 and bf16, unpacked and packed), logits must be bitwise
   equal to the resident mode's in staging and cache modes at every size, policy and store, and
   greedy generations identical; overwriting a slot must change the logits (compute reads slots);
   verify mode must catch a corrupted slot. The pinned RAM tier (checked on Qwen3-30B-A3B's
   shapes) takes its own bytes, not a power of two above them, and frees them with its model.
2. Quantized experts: every tensor of the GGUF fixtures (tests/fixtures/gguf, all 15 storage
   types) dequantized on the GPU must equal the CPU's dequantization bitwise, and a GGUF model's
   logits must be bitwise equal across cache modes on the GPU, with experts as the file's blocks.
3. On a checkpoint with Qwen3-30B-A3B's layer shapes (2 layers): a 4096-token prompt with the
   cache at 25% must read at most 1.2x all expert bytes host-to-device (one stretch), shown beside
   micro-batches of 512 and the resident mode's speed; decode and prefill speed in resident,
   staging and cache modes at 25/50/75% with the pinned RAM store.
4. Prefetch (a second, lower-priority copy stream with events): on the small checkpoint, logits
   and greedy tokens bitwise equal to the resident mode's with prefetch on and off at several
   widths, sizes, policies and stores; the counters exactly those of the trace simulator replaying
   the run's routing and predictions; a prefetch worker slowed down or failing (the disk store's
   read hook) changes no bit and leaves every resident slot holding its expert's bytes.
   `--only-prefetch` runs this check alone.
5. Qwen3.5/3.6-MoE (Gated DeltaNet, gated attention, a shared expert) and Gemma 4 (sliding window
   of 16, a dense MLP beside the experts, k-eq-v), each a tiny random fp32 checkpoint and a GGUF
   computed in bf16 (Q8_0 from llama.cpp's converter; Q4_K_M from synth): on a 150-token prompt
   (three DeltaNet chunks, past the window), logits and the prompt in stretches of 48 and
   micro-batches of 16 bitwise equal to the resident mode's in staging mode (each store) and
   cache mode at 1 expert, 25% and all, with lrfu and lru and prefetch on and off (the three
   stores in turn); at 1 expert and 25% with lrfu, also 16 decode steps (`prefill` one token at
   a time) and greedy tokens. In fp32, micro-batches and decode steps within 1e-4 of one forward
   over the same tokens (largest difference over the largest logit; sums in another order, so
   not bitwise).
   `--only-architectures` runs this check alone.
6. `--profile` (alone): torch's profiler over decode steps on the Qwen3-30B-A3B shapes, resident
   and cached, the ops by host time beside device time (where a step's time goes on this device).
Prints a table for each; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import expertcache
from expertcache import CacheConfig, ExpertCacheError
from expertcache.models.mixers import describe_layers
from expertcache.models.pack import pack
from expertcache.models.synth import synth
from expertcache.tiers.policy import ExpertKey, POLICIES
from expertcache.tiers.transfer import COPY_THREAD

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf"


def exactness(device: str, root: Path) -> list[tuple[str, bool, str]]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        plain = synth(root / f"tiny-{dtype}", like="tiny", layers=3, experts=32, top_k=4, vocab=512, dtype=dtype,
                      progress=False)
        packed = pack(plain, root / f"tiny-{dtype}-packed", progress=False)
        ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(0))
        base_model = expertcache.load(plain, device=device, cache=CacheConfig(mode="resident"), prefill_stretch=48)
        base = base_model.logits(ids)
        stretched = base_model.prefill(base_model.new_session(), ids.tolist(), ubatch=16, all_logits=True)
        base_gen = base_model.generate(ids[:16].tolist(), max_tokens=24, ignore_eos=True).token_ids
        total = 32 * 3
        configs = [CacheConfig(mode="staging", store=s) for s in ("ram", "mmap", "disk")]
        configs += [CacheConfig(mode="cache", experts=n, policy=p, store=s)
                    for n in (1, total // 10, total // 4, total // 2, total)
                    for p in sorted(POLICIES) for s in ("ram", "mmap", "disk")]
        n_ok, first_bad = 0, ""
        for layout, path in (("plain", plain), ("packed", packed)):
            for cfg in configs:
                model = expertcache.load(path, device=device, cache=cfg, prefill_stretch=48)
                ok = all(torch.equal(model.logits(ids), base) for _ in range(2))
                # a prompt in stretches of 48 tokens, attention in micro-batches of 16
                ok = ok and torch.equal(model.prefill(model.new_session(), ids.tolist(), ubatch=16, all_logits=True),
                                        stretched)
                if ok and cfg.experts in (1, total // 4):
                    ok = model.generate(ids[:16].tolist(), max_tokens=24, ignore_eos=True).token_ids == base_gen
                n_ok += ok
                if not ok and not first_bad:
                    first_bad = f"{layout} {cfg.mode} experts={cfg.experts} {cfg.policy} {cfg.store}"
        n = 2 * len(configs)
        rows.append((f"bitwise logits, stretches, greedy, {dtype}: {n_ok}/{n} configs", n_ok == n, first_bad))

        model = expertcache.load(plain, device=device, cache=CacheConfig(mode="cache", verify=True))
        seen = []
        model.net.routing_hook = lambda layer, r: seen.append((layer, int(r.ids[0, 0])))
        before = model.logits(ids)
        model.net.routing_hook = None
        layer, expert = seen[0]
        slot = model.experts.residency.slot_of(ExpertKey(layer, expert))
        model.experts.pool[slot, 3] += 1
        try:
            model.logits(ids)
            rows.append((f"verify catches a corrupted slot, {dtype}", False, "no error raised"))
        except ExpertCacheError as e:
            rows.append((f"verify catches a corrupted slot, {dtype}", f"slot {slot}" in str(e), str(e)))
        model.experts.config = dataclasses.replace(model.experts.config, verify=False)
        rows.append((f"compute reads the slots, {dtype}", not torch.equal(model.logits(ids), before), ""))
    return rows


def pinned_tier(device: str, root: Path) -> tuple[str, bool, str]:
    """The pinned RAM tier of Qwen3-30B-A3B's shapes (1152 MiB a layer) takes its own bytes, not
    torch's power of two above them (2048 MiB), and gives them back when its model is dropped
    (memory.EXACT_PINNED). Pinned blocks of 1 MiB or less keep torch's rounding and caching."""
    import gc

    def pinned() -> int:  # the host allocator's blocks, in use and cached
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    before = pinned()
    model = expertcache.load(_qwen3_30b_shapes(root), device=device,
                             cache=CacheConfig(mode="cache", fraction=0.25, store="ram"), ctx_size=256)
    model.generate([1, 2, 3], max_tokens=4, ignore_eos=True)  # copies from the tier, on the copy stream
    want = sum(r.nbytes for r in model.experts.store.rows.values())
    got = pinned() - before
    del model
    gc.collect()
    torch.cuda.synchronize()
    probe = torch.empty(1, pin_memory=True)  # an allocation: the allocator frees what waited on events
    left = pinned() - before - probe.nbytes
    ok = want <= got < want + (1 << 20) and left < (1 << 20)
    return (f"pinned RAM tier: {got / 2**20:.0f} MiB for {want / 2**20:.0f}, {left / 2**20:.1f} MiB left once dropped",
            ok, f"pinned {got}, rows {want}, left {left}")


def prefetch_checks(device: str, root: Path) -> list[tuple[str, bool, str]]:
    import threading

    from expertcache.bench.simulate import simulate
    from expertcache.bench.trace import TraceRecorder
    from expertcache.errors import CopyError

    rows = []
    plain = synth(root / "pf-tiny", like="tiny", layers=3, experts=32, top_k=4, vocab=512, dtype="bfloat16",
                  progress=False)
    packed = pack(plain, root / "pf-tiny-packed", progress=False)
    ids = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(2))
    ref_model = expertcache.load(packed, device=device, cache=CacheConfig(mode="resident"))
    base, base_gen = ref_model.logits(ids), ref_model.generate(ids[:12].tolist(), max_tokens=16,
                                                               ignore_eos=True).token_ids

    def slots_ok(cache) -> bool:
        cache.quiesce()
        for key in cache.residency.resident_keys():
            slot = cache.residency.slot_of(key)
            want = torch.zeros_like(cache.pool[slot: slot + 1])
            cache.store.copy_run(key.layer, key.expert, want)
            if not torch.equal(cache.pool[slot], want[0]):
                return False
        return True

    n_ok, bad = 0, ""
    configs = [(pf, w, n, p, st) for pf in ("off", "on") for w in (1.0, 2.0) for n in (4, 24, 48)
               for p in ("lrfu", "lru") for st in ("ram", "mmap", "disk")]
    for pf, width, n, policy, store in configs:
        model = expertcache.load(packed, device=device, cache=CacheConfig(
            mode="cache", experts=n, policy=policy, store=store, prefetch=pf, prefetch_width=width))
        ok = all(torch.equal(model.logits(ids), base) for _ in range(2))
        ok = ok and model.generate(ids[:12].tolist(), max_tokens=16, ignore_eos=True).token_ids == base_gen
        ok = ok and slots_ok(model.experts)
        n_ok += ok
        if not ok and not bad:
            bad = f"prefetch {pf} width {width} experts={n} {policy} {store}"
    rows.append((f"prefetch on/off bitwise logits, greedy: {n_ok}/{len(configs)}", n_ok == len(configs), bad))

    n_ok, bad = 0, ""
    for n, width, store, floor in ((8, 1.0, "ram", 0.0), (24, 2.0, "ram", 0.0), (24, 1.5, "disk", 0.0),
                                   (24, 2.0, "disk", 0.1)):
        model = expertcache.load(packed, device=device, cache=CacheConfig(
            mode="cache", experts=n, store=store, prefetch="on", prefetch_width=width, prefetch_min_prob=floor))
        rec = TraceRecorder.for_model(model, predict=True)
        rec.generate(model, ids[:20].tolist(), max_tokens=12, ubatch=8, ignore_eos=True)
        t = rec.trace()
        total = model.telemetry()["total"]
        sim = simulate(t.ops(), n, model.experts.config.policy, t.header.expert_bytes, t.predictions(width, floor))
        got = (total["resident_hits"], total["demand_misses"], total["evictions"], total["copied_bytes"],
               total["prefetch_issued"], total["prefetch_used"], total["prefetch_wasted"])
        want = (sim.hits, sim.misses, sim.evictions, sim.bytes_moved, sim.prefetch_issued, sim.prefetch_used,
                sim.prefetch_wasted)
        n_ok += got == want and sim.prefetch_issued > 0
        if got != want and not bad:
            bad = f"experts={n} width {width} min-prob {floor} {store}: runtime {got}, simulator {want}"
    rows.append((f"prefetch counters equal the simulator's: {n_ok}/4", n_ok == 4, bad))

    for what, action in (("slowed", "sleep"), ("failing", "raise")):
        model = expertcache.load(packed, device=device, cache=CacheConfig(
            mode="cache", experts=24, store="disk", prefetch="on", prefetch_width=2.0))

        def hook(_n, action=action):
            if threading.current_thread().name == COPY_THREAD:
                if action == "sleep":
                    time.sleep(0.005)
                else:
                    raise CopyError("injected read failure")

        model.experts.store.read_hook = hook
        ok = all(torch.equal(model.logits(ids), base) for _ in range(2))
        ok = ok and model.generate(ids[:12].tolist(), max_tokens=16, ignore_eos=True).token_ids == base_gen
        ok = ok and slots_ok(model.experts)
        fails = model.telemetry()["copy_failures"]
        ok = ok and (fails > 0) == (action == "raise")
        rows.append((f"prefetch worker {what}: bitwise, slots hold their experts", ok, f"copy_failures={fails}"))
    return rows


def _qwen3_30b_shapes(root: Path) -> Path:
    """A bf16 checkpoint with Qwen3-30B-A3B's layer shapes (2 layers), made once per run."""
    path = root / "qwen3-30b-a3b-2l"
    if not path.exists():
        synth(path, like="qwen3-30b-a3b", layers=2, vocab=4096, dtype="bfloat16")
    return path


def bench(device: str, root: Path, threads: int) -> list[dict]:
    path = _qwen3_30b_shapes(root)
    out = []
    prompt = torch.randint(0, 4096, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    configs = [("resident", None), ("staging", None), ("cache", 0.25), ("cache", 0.5), ("cache", 0.75)]
    for mode, frac in configs:
        model = expertcache.load(path, device=device, cache=CacheConfig(mode=mode, fraction=frac, store="ram"),
                                 ctx_size=1024)
        model.generate(prompt[:8], max_tokens=4, ignore_eos=True)  # warm-up
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        s = model.new_session()
        sync()
        t = time.perf_counter()
        model.prefill(s, prompt)
        sync()
        prefill_s = time.perf_counter() - t
        before = model.telemetry()["total"]
        tok = prompt[-1]
        t = time.perf_counter()
        for _ in range(64):
            tok = int(model.prefill(s, [tok]).argmax())
        sync()
        decode_s = time.perf_counter() - t
        after = model.telemetry()["total"]
        used = after["used_experts_unique"] - before["used_experts_unique"]
        hits = after["resident_hits"] - before["resident_hits"]
        copied = after["copied_bytes"] - before["copied_bytes"]
        out.append({"mode": mode, "fraction": frac, "prefill_tok_s": len(prompt) / prefill_s,
                    "decode_tok_s": 64 / decode_s, "hit_rate": hits / used if used else 0.0,
                    "copied_mb_per_token": copied / 64 / 1e6})
        del model
    return out


def long_prompt(device: str, root: Path) -> tuple[list[tuple[str, bool, str]], list[dict]]:
    """A 4096-token prompt with the cache at 25% of the experts: host-to-device bytes per prompt in
    one stretch against micro-batches of 512 (a stretch each), and the speed of both beside the
    resident mode's."""
    path = _qwen3_30b_shapes(root)
    prompt = torch.randint(0, 4096, (4096,), generator=torch.Generator().manual_seed(2)).tolist()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out = []
    for mode, frac, stretch in (("resident", None, 4096), ("cache", 0.25, 4096), ("cache", 0.25, 512)):
        model = expertcache.load(path, device=device, cache=CacheConfig(mode=mode, fraction=frac, store="ram"),
                                 ctx_size=4200, prefill_stretch=stretch)
        # Warm-up on the same prompt: the first products of each shape pay for the device's
        # one-time costs (kernel loading, allocator growth), which are not the prompt's.
        model.prefill(model.new_session(), prompt)
        if mode == "cache":
            model.experts.resize(model.experts.config)  # every slot emptied: the timed prompt starts cold
        sync()
        t = time.perf_counter()
        model.prefill(model.new_session(), prompt)
        sync()
        seconds = time.perf_counter() - t
        all_bytes = sum(model.experts.expert_bytes[i] for i in model.cfg.moe_layers) * model.cfg.num_experts
        out.append({"mode": mode, "fraction": frac, "stretch": stretch, "tok_s": len(prompt) / seconds,
                    "read_x_all": model.last_prefill.bytes_read / all_bytes})
        del model
    one = out[1]["read_x_all"]
    return [(f"4096-token prompt at 25%: bytes read {one:.2f}x all expert bytes (<= 1.2)", one <= 1.2, "")], out


def quantized(device: str) -> list[tuple[str, bool, str]]:
    from expertcache.checkpoint.gguf_io import GGUFCheckpoint
    from expertcache.checkpoint.storage import is_quantized
    from expertcache.kernels.dequant import dequantize

    n = bad = 0
    first_bad = ""
    for path in sorted(FIXTURES.glob("*.gguf")):
        gg = GGUFCheckpoint(path)
        for name, info in gg.tensors.items():
            if not is_quantized(info.storage):
                continue
            raw = gg.read(name)
            same = torch.equal(dequantize(raw.to(device), info.storage, info.shape).cpu(),
                               dequantize(raw, info.storage, info.shape))
            n += 1
            if not same:
                bad += 1
                first_bad = first_bad or f"{path.name}:{name} ({info.storage.name})"
    rows = [(f"GPU dequantization == CPU's, bitwise: {n - bad}/{n} tensors", bad == 0 and n > 0, first_bad)]
    model_path = FIXTURES / "qwen3_moe-mix.gguf"
    ids = torch.randint(0, 4096, (48,), generator=torch.Generator().manual_seed(1))
    for dtype in ("float32", "bfloat16"):
        base = expertcache.load(model_path, device=device, dtype=dtype).logits(ids)
        configs = [CacheConfig(mode="staging", store=st) for st in ("ram", "disk")]
        configs += [CacheConfig(mode="cache", experts=k, store=st) for k in (1, 4) for st in ("ram", "mmap", "disk")]
        ok = [torch.equal(expertcache.load(model_path, device=device, dtype=dtype, cache=c).logits(ids), base)
              for c in configs]
        bad_cfg = next((f"{c.mode} experts={c.experts} {c.store}" for c, o in zip(configs, ok) if not o), "")
        rows.append((f"GGUF (quantized experts) bitwise across modes, {dtype}: {sum(ok)}/{len(ok)}", all(ok), bad_cfg))
    return rows


# Tiny shapes of the two newer families (synth's presets, made small): Qwen3.5/3.6-MoE with three
# Gated DeltaNet layers (2 key, 4 value heads) and one gated attention layer; Gemma 4 with three
# sliding-window layers (a window of WINDOW tokens) and one full layer (k-eq-v, its own head size).
WINDOW = 16
QWEN35_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   max_position_embeddings=1024)
GEMMA4_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                   num_global_key_value_heads=1, sliding_window=WINDOW, moe_intermediate_size=32,
                   intermediate_size=48, max_position_embeddings=1024)
# As a Q4_K_M GGUF: rows of 256 weights, so that the recipe's Q4_K and Q6_K blocks are what is
# written (narrower rows fall back to Q5_0 and Q8_0).
GEMMA4_TINY_Q = {**GEMMA4_TINY, "hidden_size": 256, "head_dim": 64, "global_head_dim": 128,
                 "moe_intermediate_size": 256, "intermediate_size": 256}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest logit."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def architectures(device: str, root: Path) -> list[tuple[str, bool, str]]:
    """Qwen3.5/3.6-MoE (DeltaNet, gated attention, shared expert) and Gemma 4 (sliding window,
    dense MLP beside the experts, k-eq-v): tiny random checkpoints in fp32 and their GGUF forms in
    bf16 (the default compute dtype of quantized files; Q8_0 from llama.cpp's converter, Q4_K_M
    from synth). A 150-token prompt: more than Gemma's window and three DeltaNet chunks of 64."""
    from expertcache.models.synth_gguf import synth_gguf

    models = [
        ("qwen3.5-moe", synth(root / "qwen35-tiny", like="qwen3.6-35b-a3b", layers=4, experts=16, top_k=4,
                              vocab=512, dtype="float32", progress=False, overrides=QWEN35_TINY), "float32"),
        ("gemma4", synth(root / "gemma4-tiny", like="gemma-4-26b-a4b", layers=4, experts=16, top_k=4, vocab=512,
                         dtype="float32", progress=False, overrides=GEMMA4_TINY), "float32"),
        ("qwen3.5-moe Q8_0", FIXTURES / "qwen3_5_moe" / "qwen3_5_moe-Q8_0.gguf", "bfloat16"),
        ("gemma4 Q4_K_M", synth_gguf(root / "gemma4-tiny-q4km.gguf", like="gemma-4-26b-a4b", layers=4, experts=8,
                                     top_k=2, vocab=512, progress=False, overrides=GEMMA4_TINY_Q), "bfloat16"),
    ]
    rows = []
    for name, path, dtype in models:
        try:
            rows += _architecture(name, path, dtype, device)
        except Exception as e:  # a first run on a device: the other sections' rows still print
            traceback.print_exc()
            rows.append((f"{name}: ran", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    return rows


def _architecture(name: str, path: Path, dtype: str, device: str) -> list[tuple[str, bool, str]]:
    # torch's kernels on every device: what a GPU runs (the native ones are CPU-only, and tested
    # by the test suite), so that the CPU run of this section checks the same code.
    def load(cache: CacheConfig, dt: str = dtype) -> expertcache.Model:
        return expertcache.load(path, device=device, dtype=dt, cache=cache, prefill_stretch=48, kernels="torch")

    ref = load(CacheConfig(mode="resident"))
    cfg, mixers = ref.cfg, tuple(lw.mixer for lw in ref.net.weights.layers)
    windows = sorted({m.window for m in mixers if m.window is not None})
    T, prompt = 150, 134  # the last 16 tokens decoded one at a time: Gemma's ring of 16 wraps
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(3))

    def run(model, decode: bool) -> dict:
        out = {"logits": [model.logits(ids) for _ in range(2)],
               # stretches of 48 tokens, mixers in micro-batches of 16 (DeltaNet's state and the
               # ring carried across them)
               "stretched": model.prefill(model.new_session(), ids.tolist(), ubatch=16, all_logits=True)}
        if decode:
            s = model.new_session()
            steps = [model.prefill(s, ids[:prompt].tolist(), ubatch=16, all_logits=True)]
            steps += [model.prefill(s, [t], all_logits=True) for t in ids[prompt:].tolist()]
            out["steps"] = torch.cat(steps)
            out["greedy"] = model.generate(ids[:24].tolist(), max_tokens=12, ignore_eos=True).token_ids
        return out

    base = run(ref, decode=True)
    rows = []
    # One forward against micro-batches and decode steps over the same tokens, in fp32: equal up
    # to the order of fp32 sums (a [T, K] product and T one-row products, DeltaNet's chunked form
    # and its recurrent form, attention over T queries and over one), so not bitwise; measured
    # here 1e-6 to 1e-5 of the largest logit on the CPU.
    exact = base if dtype == "float32" else run(load(CacheConfig(mode="resident"), "float32"), decode=True)
    full = exact["logits"][0]
    rel = max(_rel(exact["stretched"], full), _rel(exact["steps"], full))
    # what the prompt must reach: a third DeltaNet chunk, and a window's worth of decode steps
    reach = T > 2 * 64 and all(w <= T - prompt for w in windows)
    rows.append((f"{name} fp32: stepwise vs one forward {rel:.1e} (<= 1e-4)", rel <= 1e-4 and reach,
                 f"layers {describe_layers(mixers)}, windows {windows}, {T} tokens, {T - prompt} decoded"))

    total = len(cfg.moe_layers) * cfg.num_experts
    stores = iter(("ram", "mmap", "disk") * 4)
    configs = [CacheConfig(mode="staging", store=st) for st in ("ram", "mmap", "disk")]
    configs += [CacheConfig(mode="cache", experts=n, policy=p, store=next(stores), prefetch=pf)
                for n in (1, total // 4, total) for p in ("lrfu", "lru") for pf in ("off", "on")]
    n_ok, first_bad = 0, ""
    for c in configs:
        decode = c.experts in (1, total // 4) and c.policy == "lrfu"
        what = f"{c.mode} experts={c.experts} {c.policy} {c.store} prefetch {c.prefetch}"
        try:
            got = run(load(c), decode)
        except Exception as e:
            first_bad = first_bad or f"{what}: {type(e).__name__}: {e}"
            continue
        ok = all(torch.equal(g, base["logits"][0]) for g in got["logits"])
        ok = ok and torch.equal(got["stretched"], base["stretched"])
        if decode:
            ok = ok and torch.equal(got["steps"], base["steps"]) and got["greedy"] == base["greedy"]
        n_ok += ok
        if not ok and not first_bad:
            first_bad = what
    short = "fp32" if dtype == "float32" else "bf16"
    rows.append((f"{name} {short}: bitwise logits, decode, greedy {n_ok}/{len(configs)}",
                 n_ok == len(configs), first_bad))
    return rows


def profile_decode(device: str, root: Path, threads: int) -> None:
    """Where a decode step's time goes on this device: torch's profiler over 8 steps of the
    Qwen3-30B-A3B-shaped checkpoint, resident and with the cache at 25%, the ops by their own host
    time (launch and synchronisation costs show there) beside their device time."""
    from torch.profiler import ProfilerActivity, profile

    path = _qwen3_30b_shapes(root)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for mode, frac in (("resident", None), ("cache", 0.25)):
        model = expertcache.load(path, device=device, cache=CacheConfig(mode=mode, fraction=frac, store="ram"),
                                 ctx_size=256)
        s = model.new_session()
        tok = int(model.prefill(s, list(range(1, 65))).argmax())
        for _ in range(8):  # warm-up: first-call costs are not the step's
            tok = int(model.prefill(s, [tok]).argmax())
        sync()
        t = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(8):
                tok = int(model.prefill(s, [tok]).argmax())
            sync()
        wall = (time.perf_counter() - t) / 8
        events = prof.key_averages()
        n_ops = sum(e.count for e in events if e.key.startswith("aten::")) / 8
        print(f"\ndecode step, {mode}{'' if frac is None else f' {frac:.0%}'}: {wall * 1e3:.2f} ms under the profiler, "
              f"{n_ops:.0f} aten calls per step")
        print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40))
        del model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--only-prefetch", action="store_true", help="run the prefetch checks alone")
    ap.add_argument("--only-architectures", action="store_true",
                    help="run the Qwen3.5-MoE and Gemma 4 checks alone")
    ap.add_argument("--profile", action="store_true",
                    help="profile decode steps (torch's profiler) on Qwen3-30B-A3B shapes, and nothing else")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {name}, torch {torch.__version__}, threads {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            profile_decode(args.device, Path(tmp), args.threads)
            return 0
        t0 = time.perf_counter()
        if args.only_prefetch:
            rows = prefetch_checks(args.device, Path(tmp))
        elif args.only_architectures:
            rows = architectures(args.device, Path(tmp))
        else:
            rows = exactness(args.device, Path(tmp)) + quantized(args.device) + prefetch_checks(args.device, Path(tmp))
            if args.device.startswith("cuda"):
                rows.append(pinned_tier(args.device, Path(tmp)))
            rows += architectures(args.device, Path(tmp))
        print(f"\n{'check':<64} result  ({time.perf_counter() - t0:.0f} s)")
        for what, ok, detail in rows:
            print(f"{what:<64} {'PASS' if ok else 'FAIL'}  {'' if ok else detail}")
        if not args.skip_bench and not (args.only_prefetch or args.only_architectures):
            t0 = time.perf_counter()
            checks, res = long_prompt(args.device, Path(tmp))
            rows += checks
            print(f"\nlong prompt, Qwen3-30B-A3B shapes, 2 layers, ram store ({time.perf_counter() - t0:.0f} s)")
            print(f"{'mode':<9}{'capacity':>9}{'stretch':>8}{'prefill 4096 t/s':>18}{'bytes read x all experts':>26}")
            for r in res:
                cap = "all" if r["mode"] == "resident" else f"{r['fraction']:.0%}"
                print(f"{r['mode']:<9}{cap:>9}{r['stretch']:>8}{r['tok_s']:>18.1f}{r['read_x_all']:>26.2f}")
            for what, ok, detail in checks:
                print(f"{what:<64} {'PASS' if ok else 'FAIL'}  {detail}")
            t0 = time.perf_counter()
            res = bench(args.device, Path(tmp), args.threads)
            print(f"\nQwen3-30B-A3B shapes, 2 layers, bf16, ram store ({time.perf_counter() - t0:.0f} s)")
            print(f"{'mode':<9}{'capacity':>9}{'prefill 512 t/s':>17}{'decode t/s':>12}{'hit rate':>10}{'MB/token':>10}")
            for r in res:
                cap = "all" if r["mode"] == "resident" else ("-" if r["fraction"] is None else f"{r['fraction']:.0%}")
                print(f"{r['mode']:<9}{cap:>9}{r['prefill_tok_s']:>17.1f}{r['decode_tok_s']:>12.1f}"
                      f"{r['hit_rate']:>10.3f}{r['copied_mb_per_token']:>10.1f}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
