"""`expertcache bench speed`: decode and prefill speed, where the time goes, and how close it is
to what the machine can do.

- Decode (batch 1, after a prompt): tok/s, time per token split into routing, attention,
  experts, copies and the rest, and the achieved weight-read bandwidth as a fraction of a read
  bandwidth measured here on buffers far larger than the last-level cache.
- Prefill (256, 512, 2048 tokens, each timed after one untimed pass of the same length): tok/s
  and achieved matrix FLOP/s as a fraction of a measured matrix-product rate in the model's dtype.
- `resident` mode and `cache` mode at 25/50/75% (and `staging`) with the `ram` store; for cache
  and staging, the decode bound `resident time + missed bytes / measured copy bandwidth` and the
  ratio of the measured time to it, each mode timed `--pairs` times right after the resident
  mode (kept loaded for this) and the median of the pairs' ratios reported.
- The per-token cost outside the matrix products (Python, dispatch, bookkeeping), from the torch
  profiler, and the cache's own bookkeeping per MoE op as a fraction of the step.
- `--vs-llamacpp FILE.gguf` runs llama.cpp (llama-cpp-python, in a child process) on the same
  weights in the same run, alternating with our resident mode `--pairs` times, and reports the
  median of the pairs' ratios.
Table, then one JSON line.
"""

from __future__ import annotations

import dataclasses

import gc
import multiprocessing
import os
import statistics
import sys
import textwrap
import time

import torch
from tqdm import tqdm

from ..errors import ExpertCacheError
from ..memory import host_zeros
from ..telemetry import StepTimer

PREFILLS = (256, 512, 2048)
# Before each run of a pair (`side_by_side`), both processes' CPU time must grow by less than
# IDLE_SHARE of one core over IDLE_WINDOW_S: their OpenMP workers have stopped spinning. At most
# IDLE_LIMIT_S is waited; where /proc cannot be read, SETTLE_S is waited instead.
IDLE_WINDOW_S = 0.1
IDLE_SHARE = 0.2
IDLE_LIMIT_S = 3.0
SETTLE_S = 0.5


def _cpu_seconds(pids: list[int]) -> float | None:
    """User plus system CPU seconds of `pids` (all their threads), from /proc; None if unreadable."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def wait_idle(pids: list[int]) -> float:
    """Return once `pids` have used less than IDLE_SHARE of a core for IDLE_WINDOW_S (or after
    IDLE_LIMIT_S); the seconds waited."""
    start = time.perf_counter()
    before = _cpu_seconds(pids)
    if before is None:
        time.sleep(SETTLE_S)
        return SETTLE_S
    while True:
        time.sleep(IDLE_WINDOW_S)
        now = _cpu_seconds(pids)
        waited = time.perf_counter() - start
        if now is None or now - before < IDLE_SHARE * IDLE_WINDOW_S or waited >= IDLE_LIMIT_S:
            return waited
        before = now


# Profiler names of the matrix products (and fused attention) a step runs.
MATRIX_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mv", "aten::addmv_",
              "aten::_scaled_dot_product_flash_attention_for_cpu", "native::gemv", "native::experts",
              "native::attend", "native::deltanet_step",
              # the products over quantized blocks (GGUF files)
              "quant::gemv", "quant::experts", "quant::gemm_tiles", "quant::gemm_act8")

# Ops outside the products listed by `overhead_profile` (the costliest).
OUTSIDE_OPS_SHOWN = 8


def measure_read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a streaming read (a sum) over a buffer far larger than the last-level cache, on
    the same huge-page memory the weights are in."""
    buf = host_zeros((nbytes // 4,), torch.float32)
    best = 0.0
    for _ in range(4):
        t = time.perf_counter()
        buf.sum()
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


def measure_copy_bandwidth(nbytes: int = 1 << 29) -> float:
    """Bytes/s copied host to host (what a slot fill from the `ram` store does), counting bytes copied."""
    src = host_zeros((nbytes,), torch.uint8)
    dst = host_zeros((nbytes,), torch.uint8)
    best = 0.0
    for _ in range(4):
        t = time.perf_counter()
        dst.copy_(src)
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


def measure_matmul_rate(hidden: int, inter: int, dtype: torch.dtype) -> float:
    """FLOP/s of a [512 x hidden] x [hidden x 2*inter] product in the model's dtype."""
    x = torch.randn(512, hidden).to(dtype)
    w = torch.randn(2 * inter, hidden).to(dtype)
    torch.nn.functional.linear(x, w)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = max(best, 2 * 512 * hidden * 2 * inter / (time.perf_counter() - t))
    return best


def weight_bytes_per_token(model) -> dict:
    """Bytes of weights one decode step reads: dense parts, top-k experts per MoE layer, LM head
    (quantized matrices count their blocks' bytes), and `weights`, how many weights those are."""
    cfg, w = model.cfg, model.net.weights
    dense = 0
    for lw in w.layers:
        dense += lw.mixer.weight_bytes(lw.attn)
        if lw.router is not None:
            dense += lw.router.nbytes
        for mlp in (lw.dense, lw.shared):
            if mlp is not None:
                dense += mlp.gate_up.nbytes + mlp.down.nbytes
    experts = cfg.top_k * sum(model.experts.expert_bytes.values())
    head = w.lm_head.nbytes
    return {"dense": dense, "experts": experts, "lm_head": head, "total": dense + experts + head,
            "weights": _weights_per_token(model)}


def _activations(model) -> str:
    """How the model's quantized products take their input (`--activations`), in words."""
    k = model.kernels if model is not None else None
    if k is None or not k.act8:
        return "exact"
    from ..kernels import ALL_ROWS

    return "q8" if k.act8_rows >= ALL_ROWS else f"q8 up to {k.act8_rows} rows, exact beyond"


def _weights_per_token(model) -> int:
    """Weights one token multiplies, the LM head left out: every dense matrix of the layers and
    top-k experts of 3 x hidden x expert width each."""
    cfg, w = model.cfg, model.net.weights
    n = 0
    for lw in w.layers:
        for f in dataclasses.fields(lw.attn):  # the mixer's matrices (a few small norm tables too)
            value = getattr(lw.attn, f.name)
            if hasattr(value, "shape") and len(value.shape) == 2:
                n += value.shape[0] * value.shape[1]
        for m in (lw.router, *(x for mlp in (lw.dense, lw.shared) if mlp is not None for x in (mlp.gate_up, mlp.down))):
            if m is not None:
                n += m.shape[0] * m.shape[1]
    return n + cfg.top_k * len(cfg.moe_layers) * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def matmul_flops_per_token(model) -> int:
    """Matrix FLOPs per prompt token (2 x active weights, without the LM head: prefill keeps one row)."""
    return 2 * weight_bytes_per_token(model)["weights"]


class _CopyTimer(StepTimer):
    """A `StepTimer` that charges the copies made during a lap (the cache's `copy_seconds` grew)
    to `copies` instead of the lap they fell in. They do not always fall in `experts`: Gemma 4's
    dense MLP runs as the op's `meanwhile`, after the op's copies on a CPU without the split, so
    its lap held them and `experts`, less all copies, went below zero."""

    def __init__(self, telemetry) -> None:
        self._telemetry = telemetry
        super().__init__()
        self._copied = telemetry.copy_seconds

    def start(self) -> None:
        super().start()
        self._copied = self._telemetry.copy_seconds

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        copied = self._telemetry.copy_seconds
        copies = copied - self._copied
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last - copies
        if copies:
            self.seconds["copies"] = self.seconds.get("copies", 0.0) + copies
        self._last, self._copied = now, copied


def _decode(model, prompt: list[int], n: int) -> dict:
    s = model.new_session()
    model.prefill(s, prompt)
    tok = prompt[-1]
    before = model.telemetry()
    timer = _CopyTimer(model.experts.telemetry_)
    model.net.timer = timer
    t = time.perf_counter()
    for _ in range(n):
        tok = int(model.prefill(s, [tok]).argmax())
    wall = time.perf_counter() - t
    model.net.timer = None
    after = model.telemetry()
    copies = after["copy_seconds"] - before["copy_seconds"]
    parts = {k: v / n for k, v in timer.seconds.items()}
    # Every copy of the steps, those made outside a forward's laps too (they leave `rest`).
    parts["copies"] = copies / n
    parts["rest"] = wall / n - sum(v for k, v in parts.items())
    missed = after["total"]["copied_bytes"] - before["total"]["copied_bytes"]
    hits = after["total"]["resident_hits"] - before["total"]["resident_hits"]
    used = after["total"]["used_experts_unique"] - before["total"]["used_experts_unique"]
    return {"tok_s": n / wall, "ms_per_token": 1e3 * wall / n,
            "split_ms": {k: 1e3 * v for k, v in parts.items()},
            "missed_bytes_per_token": missed / n, "hit_rate": hits / used if used else 0.0}


def _prefill(model, prompt: list[int], ubatch: int) -> dict:
    # One untimed pass first: oneDNN builds a kernel for every new product shape (each expert's
    # row count is one), and without it the first mode measured would pay for all of them.
    model.prefill(model.new_session(), prompt, ubatch)
    s = model.new_session()
    t = time.perf_counter()
    model.prefill(s, prompt, ubatch)
    wall = time.perf_counter() - t
    return {"tokens": len(prompt), "tok_s": len(prompt) / wall, "seconds": wall}


class _Profiled:
    """A native module with each call named in the profiler (`native::gemv`, `quant::experts`, ...)."""

    def __init__(self, native, prefix: str = "native"):
        self.native, self.prefix = native, prefix

    def __getattr__(self, name):
        fn = getattr(self.native, name)
        if not callable(fn):
            return fn

        def call(*args):
            with torch.profiler.record_function(f"{self.prefix}::{name}"):
                return fn(*args)
        return call


# Decode steps the profiled decode (`overhead_profile`) runs.
PROFILE_STEPS = 16


def context_size(prefills: list[int], decode: int) -> int:
    """Positions every measurement needs: the longest prompt, and a 64-token prompt followed by
    the decode steps or by the profiled steps (`--decode` below PROFILE_STEPS ran out of context
    in the profile, after the other measurements)."""
    return max(prefills) + max(decode, PROFILE_STEPS) + 72


def overhead_profile(model, prompt: list[int], n: int = PROFILE_STEPS) -> dict:
    """Decode step time outside the matrix products, and the cache's bookkeeping per MoE op."""
    from torch.profiler import ProfilerActivity, profile

    s = model.new_session()
    model.prefill(s, prompt)
    tok = prompt[-1]
    residency = model.experts.residency
    plan, spent = residency.plan, [0.0, 0]

    def timed_plan(*a, **k):
        t = time.perf_counter()
        out = plan(*a, **k)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    residency.plan = timed_plan
    kernels = model.kernels
    native, quant = kernels.native, kernels._quant
    if native is not None:
        kernels.native = _Profiled(native)
    if quant is not None:
        kernels._quant = _Profiled(quant, "quant")
    # torch's profiler (kineto) logs "profiler_start" and "profiler_stop" on stderr at its default
    # log level (they rank above ERROR): only KINETO_LOG_LEVEL=6, above every kind, keeps them off
    # the user's terminal. Kineto reads it once, when the process's first profile starts; a level
    # the user set is kept.
    quiet = "KINETO_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(n):
                tok = int(model.prefill(s, [tok]).argmax())
            wall = time.perf_counter() - t
    finally:
        if quiet:
            del os.environ["KINETO_LOG_LEVEL"]
        del residency.plan
        if native is not None:
            kernels.native = native
        kernels._quant = quant
    events = prof.key_averages()
    ops = {e.key: e.self_cpu_time_total / 1e3 / n for e in events if e.key in MATRIX_OPS}
    # The rest by op, the costliest first: which of the step's small ops add up.
    rest = sorted((e for e in events if e.key not in MATRIX_OPS), key=lambda e: -e.self_cpu_time_total)
    mm = sum(ops.values()) / 1e3 * n
    step = wall / n
    return {"step_ms": 1e3 * step, "matmul_ms": 1e3 * mm / n, "outside_matmul_ms": 1e3 * (step - mm / n),
            "matmul_ms_by_op": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
            "outside_ops_per_step": sum(e.count for e in rest) / n,
            "outside_ms_by_op": {e.key: {"ms": e.self_cpu_time_total / 1e3 / n, "calls": e.count / n}
                                 for e in rest[:OUTSIDE_OPS_SHOWN]},
            "outside_matmul_fraction": 1 - (mm / n) / step,
            "bookkeeping_us_per_op": 1e6 * spent[0] / max(spent[1], 1),
            "bookkeeping_fraction_of_step": spent[0] / wall,
            "note": "profiled steps run slower than unprofiled ones; compare fractions, not times"}


def llama_class():
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ExpertCacheError("--vs-llamacpp needs llama-cpp-python (pip install llama-cpp-python)") from None
    return Llama


def check_gguf(path: str) -> None:
    """Fail before the benchmark, not after it: the file must exist and start with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ExpertCacheError(f"--vs-llamacpp {path}: cannot read it ({e.strerror}); expected a GGUF file "
                               "(python tools/to_gguf.py -m MODEL -o FILE.gguf)") from None
    if magic != b"GGUF":
        raise ExpertCacheError(f"--vs-llamacpp {path}: not a GGUF file (it starts with {magic!r}, expected b'GGUF')")


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on a GGUF of the same weights, timed as `_decode`/`_prefill` time ours."""

    def __init__(self, gguf: str, threads: int, n_ctx: int) -> None:
        Llama = llama_class()
        try:
            self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, n_ubatch=512, verbose=False)
        except ValueError as e:  # llama-cpp-python's way of saying it could not load the file
            raise ExpertCacheError(f"--vs-llamacpp {gguf}: llama.cpp could not load it ({e})") from None

    def prefill(self, tokens: list[int]) -> float:
        llm = self.llm
        llm.reset()
        llm.eval(tokens)  # untimed, as for ours
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens)
        return len(tokens) / (time.perf_counter() - t)

    def decode(self, prompt: list[int], n: int) -> float:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        tok = prompt[-1]
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
        return n / (time.perf_counter() - t)


class LlamaCppProcess:
    """`LlamaCpp` in a child process, answering one call at a time over a pipe.

    In one process the two engines' OpenMP runtimes (torch's and llama.cpp's own) both spin on the
    cores after their parallel regions, each slowing the other's next run several-fold; setting
    `OMP_WAIT_POLICY=PASSIVE` stops that but wakes every thread from sleep at each of our many
    parallel regions per step (~0.1 ms each with 2 threads). Apart, each side runs as its users
    run it, with the default policy."""

    def __init__(self, gguf: str, threads: int, n_ctx: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no copy of our threads' state in the child
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_llamacpp_worker, args=(child, gguf, threads, n_ctx), daemon=True,
                                 name="expertcache-llamacpp")
        self._proc.start()
        child.close()
        self._reply()  # loaded, or why not

    def _reply(self):
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise ExpertCacheError(f"--vs-llamacpp: llama.cpp's process ended unexpectedly "
                                   f"(exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise ExpertCacheError(value)
        return value

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _call(self, name: str, *args):
        self._conn.send((name, args))
        return self._reply()

    def prefill(self, tokens: list[int]) -> float:
        return self._call("prefill", tokens)

    def decode(self, prompt: list[int], n: int) -> float:
        return self._call("decode", prompt, n)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def _llamacpp_worker(conn, gguf: str, threads: int, n_ctx: int) -> None:
    try:
        lc = LlamaCpp(gguf, threads, n_ctx)
    except ExpertCacheError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ok", None))
    while (msg := conn.recv()) is not None:
        name, args = msg
        try:
            conn.send(("ok", getattr(lc, name)(*args)))
        except Exception as e:  # noqa: BLE001 (said in the parent, in one line)
            conn.send(("error", f"--vs-llamacpp: llama.cpp failed in {name}: {e}"))


def median_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of the per-pair ratios ours[i] / theirs[i]: each pair ran back to back, so the
    host's load, which changes from minute to minute, weighs on both sides of a ratio alike."""
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def side_by_side(model, lc: LlamaCppProcess, prompt: list[int], decode: int, prefills: list[int], ubatch: int,
                 pairs: int) -> dict:
    """Alternate ours (resident) and llama.cpp `pairs` times on each measurement."""
    # llama.cpp maps the GGUF and reads weights on first touch; ours filled its slots at load. One
    # untimed pass of the longest prompt touches (nearly) every expert, so neither side pays that.
    lc.prefill(prompt[:max(prefills)])
    runs = {k: {"ours": [], "llamacpp": []} for k in ["decode"] + [f"prefill_{p}" for p in prefills]}

    pids = [os.getpid(), lc.pid]

    def pair(key: str, ours, theirs) -> None:
        # Each side starts once the other's threads have gone idle: an OpenMP runtime's workers
        # spin on the cores for a while after their last parallel region (without waiting, our
        # first run after llama.cpp's warm-up ran at about half speed).
        wait_idle(pids)
        runs[key]["ours"].append(ours())
        wait_idle(pids)
        runs[key]["llamacpp"].append(theirs())

    for _ in tqdm(range(pairs), desc="vs llama.cpp", unit="pair", file=sys.stderr, disable=None):
        pair("decode", lambda: _decode(model, prompt[:64], decode)["tok_s"], lambda: lc.decode(prompt[:64], decode))
        for p in prefills:
            pair(f"prefill_{p}", lambda: _prefill(model, prompt[:p], ubatch)["tok_s"], lambda: lc.prefill(prompt[:p]))
    return {"pairs": pairs, "runs": runs,
            "ratios": {k: median_ratio(v["ours"], v["llamacpp"]) for k, v in runs.items()}}


def run(args) -> dict:
    # Loaded first, so that a file llama.cpp refuses fails before the benchmark rather than after.
    lc = (LlamaCppProcess(args.vs_llamacpp, args.threads, n_ctx=context_size(args.prefill, args.decode))
          if args.vs_llamacpp else None)
    try:
        return _run(args, lc)
    finally:
        if lc is not None:
            lc.close()


def _run(args, lc: LlamaCppProcess | None) -> dict:
    import expertcache
    from expertcache import CacheConfig

    torch.set_num_threads(args.threads)
    configs = [("resident", None)] + [("cache", f) for f in args.fractions] + [("staging", None)]
    gen = torch.Generator().manual_seed(0)
    machine = {"read_bw": measure_read_bandwidth(args.threads), "copy_bw": measure_copy_bandwidth()}
    results = []
    prompt: list[int] = []
    resident = None  # kept loaded: every other mode's bound is timed in pairs against it
    # disable=None: a bar on a terminal only; in a log its carriage returns would be noise.
    bar = tqdm(configs, desc="bench speed", unit="config", file=sys.stderr, disable=None)
    for mode, frac in bar:
        model = expertcache.load(args.model, dtype=args.dtype, cache=CacheConfig(mode=mode, fraction=frac, store="ram"),
                                 ctx_size=context_size(args.prefill, args.decode), kernels=args.kernels,
                                 activations=args.activations)
        if "matmul_rate" not in machine:
            machine["matmul_rate"] = measure_matmul_rate(model.cfg.hidden_size, model.cfg.moe_intermediate_size,
                                                         model.net.dtype)
        if not prompt:  # one prompt for every mode, so that every mode routes the same tokens
            prompt = torch.randint(0, model.cfg.vocab_size, (max(args.prefill) + 64,), generator=gen).tolist()
        model.generate(prompt[:16], max_tokens=4, ignore_eos=True)  # warm-up
        row = {"mode": mode, "fraction": frac, "capacity": model.experts.capacity,
               "decode": _decode(model, prompt[:64], args.decode),
               "prefill": {str(p): _prefill(model, prompt[:p], args.ubatch) for p in args.prefill}}
        bpt = weight_bytes_per_token(model)
        d = row["decode"]
        d["read_gb_s"] = bpt["total"] * d["tok_s"] / 1e9
        d["read_fraction"] = d["read_gb_s"] * 1e9 / machine["read_bw"]
        flops = matmul_flops_per_token(model)
        for p in row["prefill"].values():
            p["gflop_s"] = flops * p["tok_s"] / 1e9
            p["matmul_fraction"] = p["gflop_s"] * 1e9 / machine["matmul_rate"]
        if mode == "resident":
            row["overhead"] = overhead_profile(model, prompt[:64])
            row["weight_bytes_per_token"] = bpt
            resident = model
        else:
            d.update(bound_pairs(resident, model, prompt[:64], args.decode, machine["copy_bw"], args.pairs))
            del model
            gc.collect()
        results.append(row)
    out = {"bench": "speed", "model": str(args.model), "threads": args.threads, "pairs": args.pairs,
           "kernels": args.kernels, "activations": _activations(resident),
           "machine": machine, "results": results}
    if lc is not None:
        out["llamacpp"] = side_by_side(resident, lc, prompt, args.decode, args.prefill, args.ubatch, args.pairs)
    return out


def bound_pairs(resident, model, prompt: list[int], n: int, copy_bw: float, pairs: int) -> dict:
    """Decode time per token over `resident time + missed bytes / copy bandwidth`, each resident
    time taken right before the mode's own, `pairs` times; the median of the pairs' ratios."""
    runs = []
    for _ in range(pairs):
        base = _decode(resident, prompt, n)["ms_per_token"]
        d = _decode(model, prompt, n)
        bound = base + 1e3 * d["missed_bytes_per_token"] / copy_bw
        runs.append({"resident_ms": base, "ms": d["ms_per_token"], "missed_bytes_per_token": d["missed_bytes_per_token"],
                     "bound_ms": bound})
    return {"bound_pairs": runs,
            "ratio_to_bound": median_ratio([r["ms"] for r in runs], [r["bound_ms"] for r in runs])}


def table(out: dict) -> str:
    m = out["machine"]
    lines = [f"machine: read {m['read_bw'] / 1e9:.1f} GB/s, copy {m['copy_bw'] / 1e9:.1f} GB/s, "
             f"matmul {m['matmul_rate'] / 1e9:.0f} GFLOP/s; threads {out['threads']}; kernels {out['kernels']}; activations {out.get('activations', 'exact')}", ""]
    head = (f"{'mode':<9}{'cap':>5} {'decode t/s':>10} {'ms/tok':>7} {'route':>6} {'attn':>6} {'exprt':>6} "
            f"{'copy':>6} {'rest':>6} {'read GB/s':>9} {'of peak':>7} {'vs bound':>8}")
    lines += [head, "-" * len(head)]
    for r in out["results"]:
        d, s = r["decode"], r["decode"]["split_ms"]
        cap = "all" if r["mode"] == "resident" else ("-" if r["fraction"] is None else f"{r['fraction']:.0%}")
        bound = f"{d['ratio_to_bound']:.2f}x" if "ratio_to_bound" in d else ""
        # Every part without a column of its own (the LM head, dense MLP layers, ...) is in `rest`, so
        # that the columns add up to ms/tok.
        rest = sum(v for k, v in s.items() if k not in ("routing", "attention", "experts", "copies"))
        lines.append(f"{r['mode']:<9}{cap:>5} {d['tok_s']:>10.2f} {d['ms_per_token']:>7.1f} "
                     f"{s.get('routing', 0):>6.1f} {s.get('attention', 0):>6.1f} {s.get('experts', 0):>6.1f} "
                     f"{s.get('copies', 0):>6.1f} {rest:>6.1f} "
                     f"{d['read_gb_s']:>9.1f} {d['read_fraction']:>7.0%} {bound:>8}")
    lines.append(textwrap.fill(
        "route, attn, exprt, copy, rest: ms per decoded token in the routers, the attention (or DeltaNet) "
        "layers, the experts' products, copying experts into slots, and the rest (dense MLPs, LM head, "
        "sampling); read GB/s: weight bytes read per token x tok/s; of peak: over the machine's read rate",
        len(head)))
    if len(out["results"]) > 1:
        lines.append(f"vs bound: decode time over (resident's, timed just before, + missed bytes / copy bandwidth), "
                     f"median of {out['pairs']} such pairs")
    lines.append("")
    # The FLOP rate of the 512-token prompt, else of the first measured: the header says which.
    lengths = list(out["results"][0]["prefill"])
    at = "512" if "512" in lengths else lengths[0]
    head = f"{'mode':<9}{'cap':>5} " + " ".join(f"{'prefill ' + p + ' t/s':>17}" for p in lengths)
    head += f" {f'GFLOP/s ({at})':>14} {'of peak':>7}"
    lines += [head, "-" * len(head)]
    for r in out["results"]:
        cap = "all" if r["mode"] == "resident" else ("-" if r["fraction"] is None else f"{r['fraction']:.0%}")
        p = r["prefill"]
        ref = p[at]
        lines.append(f"{r['mode']:<9}{cap:>5} " + " ".join(f"{v['tok_s']:>17.1f}" for v in p.values())
                     + f" {ref['gflop_s']:>14.1f} {ref['matmul_fraction']:>7.0%}")
    o = out["results"][0].get("overhead")
    if o:
        lines += ["", f"resident decode step {o['step_ms']:.1f} ms (profiled): matrix products {o['matmul_ms']:.1f} ms, "
                  f"outside them {o['outside_matmul_ms']:.1f} ms ({o['outside_matmul_fraction']:.0%}); cache "
                  f"bookkeeping {o['bookkeeping_us_per_op']:.0f} us per MoE op "
                  f"({o['bookkeeping_fraction_of_step']:.1%} of the step)",
                  f"outside the products: {o['outside_ops_per_step']:.0f} ops per step; the costliest (ms per step, "
                  "calls): " + ", ".join(f"{k} {v['ms']:.2f} ({v['calls']:.0f})"
                                         for k, v in o["outside_ms_by_op"].items())]
    if "llamacpp" in out:
        lc = out["llamacpp"]
        head = f"{'t/s, pair by pair':<14} {'ours (resident)':>26} {'llama.cpp':>26} {'ratio':>7}"
        lines += ["", f"llama.cpp side by side: {lc['pairs']} pairs, each ours then llama.cpp back to back; "
                  "ratio = median of the pairs' ratios", head, "-" * len(head)]
        for k, v in lc["runs"].items():
            lines.append(f"{k:<14} {' '.join(f'{x:.1f}' for x in v['ours']):>26} "
                         f"{' '.join(f'{x:.1f}' for x in v['llamacpp']):>26} {lc['ratios'][k]:>6.2f}x")
        lines.append("ratios (ours / llama.cpp): " + ", ".join(f"{k} {v:.2f}x" for k, v in lc["ratios"].items()))
    return "\n".join(lines)


def cmd_bench_speed(args) -> int:
    from ..models.loader import open_model

    open_model(args.model)
    if args.vs_llamacpp:
        check_gguf(args.vs_llamacpp)
        llama_class()
    out = run(args)
    print(table(out))
    from ..flags import json_line
    print(json_line(out))
    return 0


def _lengths(text: str) -> list[int]:
    """`--prefill`: prompt lengths, each a positive integer ('0' ran to "the prompt is empty")."""
    import argparse

    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid prompt lengths {text!r}: expected numbers of tokens "
                                         "such as 256,512") from None
    if not all(n >= 1 for n in out):
        raise argparse.ArgumentTypeError(f"prompt lengths {text!r} must be at least 1 token each")
    return out


def add_parser(suites) -> None:
    from ..flags import add_kernels_flag, dtype_name, positive_int, threads
    from .cache_bench import _fractions

    p = suites.add_parser("speed", help="decode/prefill speed, time split, bandwidth and FLOP/s vs the machine")
    p.add_argument("-m", "--model", required=True, help="checkpoint (use `expertcache synth` for real sizes)")
    p.add_argument("-t", "--threads", type=threads, default=torch.get_num_threads(),
                   help="CPU threads for torch (default: %(default)s, this machine's)")
    p.add_argument("--decode", type=positive_int, default=32, help="decode steps (default: 32)")
    p.add_argument("--prefill", type=_lengths, default=list(PREFILLS), metavar="N[,N...]",
                   help="prompt lengths (default: 256,512,2048)")
    p.add_argument("--fractions", type=_fractions, default=[0.25, 0.5, 0.75],
                   help="cache capacities as fractions of all experts (default: 0.25,0.5,0.75)")
    p.add_argument("--ubatch", type=positive_int, default=512, help="prefill micro-batch size (default: 512)")
    p.add_argument("--dtype", type=dtype_name, help="compute dtype: float32, bfloat16 or float16 "
                                                     "(default: the checkpoint's)")
    add_kernels_flag(p)
    p.add_argument("--vs-llamacpp", metavar="FILE.gguf", help="also run llama.cpp on these weights (llama-cpp-python)")
    p.add_argument("--pairs", type=positive_int, default=3,
                   help="how many times each mode's decode bound, and llama.cpp, is timed back to back with "
                        "the resident mode; the median of the pairs is reported (default: 3)")
    p.set_defaults(func=cmd_bench_speed)
