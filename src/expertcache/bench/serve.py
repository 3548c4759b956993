"""`expertcache bench serve`: a client that measures any OpenAI-compatible server (ours or
llama.cpp's) the way long-context MoE offloading is measured.

- steady:  sequential requests for a fixed duration after a warm-up; prompt, completion and total tok/s.
- prefill: one cold request whose prompt has a target token count (calibrated through /tokenize).
- turns:   one growing conversation, turn after turn, with the prompt cache on, up to a target context.

Requests stream (time to first token is measured at the client) and ask for usage; llama-server's
`timings` are used when the server sends them. Each suite prints a table and one JSON line last.
With `--model DIR --compare staging,cache` it starts our server in each mode in turn and prints deltas.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from ..errors import ExpertCacheError

SUITE_NAMES = ("steady", "prefill", "turns")
DEFAULT_MAX_TOKENS = {"steady": 128, "prefill": 128, "turns": 64}
HELDOUT = Path(__file__).resolve().parent.parent / "assets" / "heldout.txt"


# ---- text ----
def bench_text(path: Path = HELDOUT) -> tuple[str, str]:
    """(text, label): the bundled held-out text, or a deterministic generated text when it is missing."""
    if path.exists() and path.stat().st_size > 0:
        return path.read_text(encoding="utf-8", errors="replace"), f"heldout.txt ({path})"
    rng = random.Random(0)
    words = ["value", "index", "count", "items", "result", "name", "data", "line", "node", "key", "total", "size"]
    lines = []
    for i in range(4000):
        a, b = rng.choice(words), rng.choice(words)
        lines += [f"def {a}_{i}({b}, {a}=None):", f"    if {a} is None:", f"        {a} = {rng.randint(0, 999)}",
                  f"    return {b} * {a} + {rng.randint(0, 99)}", ""]
    return "\n".join(lines), f"generated (deterministic; {path} not found)"


# ---- HTTP ----
class Client:
    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise ExpertCacheError(f"{self.url}{path}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ExpertCacheError(f"{self.url}{path}: cannot connect: {getattr(e, 'reason', e)}") from None

    def _answer(self, path: str, r) -> dict:
        with _answer_errors(self.url + path):
            return json.loads(r.read())

    def get(self, path: str) -> dict:
        with self._open(path) as r:
            return self._answer(path, r)

    def post(self, path: str, body: dict) -> dict:
        with self._open(path, body) as r:
            return self._answer(path, r)

    def count_tokens(self, text: str) -> int:
        try:
            return len(self.post("/tokenize", {"content": text})["tokens"])
        except (ExpertCacheError, KeyError):  # vLLM's /tokenize takes `prompt` and answers `count`
            return int(self.post("/tokenize", {"prompt": text, "add_special_tokens": False})["count"])

    def stream(self, path: str, body: dict) -> dict:
        """One streamed request: latency, time to first token, text, usage and timings."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, text, usage, timings, finish = None, [], None, None, None
        with self._open(path, body) as r, _answer_errors(self.url + path):
            for raw in r:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise ExpertCacheError(f"{self.url}{path}: {err.get('message') if isinstance(err, dict) else err}")
                for c in chunk.get("choices") or []:
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(piece)
                    finish = c.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
        latency = time.perf_counter() - t0
        if ttft is None:  # no text came (e.g. only tokens that decode to nothing): the server's prompt time
            ttft = (timings or {}).get("prompt_ms", latency * 1e3) / 1e3
        return {"latency": latency, "ttft": ttft, "text": "".join(text),
                "usage": usage or {}, "timings": timings, "finish_reason": finish}


@contextlib.contextmanager
def _answer_errors(where: str):
    """An answer that breaks off (the server died mid-stream, a read timed out) or is not JSON
    (not an OpenAI-compatible server) is an `ExpertCacheError` naming the request: one line from
    the command, and with `--compare` the failure of that mode alone, as a refused connection is.
    (They were a traceback, or with `--compare` ended the run and its other modes' results.)"""
    try:
        yield
    except ValueError as e:
        raise ExpertCacheError(f"{where}: the answer is not JSON ({e}): is this an OpenAI-compatible server?") from None
    except (OSError, http.client.HTTPException) as e:
        raise ExpertCacheError(f"{where}: the answer broke off: {e!r}") from None


def calibrate(client: Client, text: str, start: int, n_tokens: int) -> str:
    """A slice of `text` from `start` that the server tokenizes to about n_tokens tokens."""
    if n_tokens < 1:
        raise ExpertCacheError(f"a prompt of {n_tokens} tokens: expected at least 1")
    sample = _window(text, start, 4000)
    cpt = len(sample) / max(1, client.count_tokens(sample))  # characters per token
    length = max(1, int(n_tokens * cpt))
    best = None
    for _ in range(8):
        piece = _window(text, start, length)
        n = client.count_tokens(piece)
        if best is None or abs(n - n_tokens) < abs(best[1] - n_tokens):
            best = (piece, n)
        if abs(n - n_tokens) <= max(1, n_tokens // 100):
            break
        length = max(1, int(length * n_tokens / max(1, n)))
    return best[0]


def _window(text: str, start: int, length: int) -> str:
    while len(text) < start + length:  # a short text repeats
        text = text + "\n" + text
    return text[start: start + length]


# ---- suites ----
def _prompt_tps(r: dict) -> tuple[float, int, int]:
    """(processed prompt tok/s, processed, cached): llama-server's timings, else usage over TTFT."""
    t = r["timings"]
    if t and "prompt_n" in t:
        return float(t.get("prompt_per_second") or 0.0), int(t["prompt_n"]), int(t.get("cache_n", 0))
    prompt = int(r["usage"].get("prompt_tokens", 0))
    cached = int((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return (prompt - cached) / r["ttft"] if r["ttft"] > 0 else 0.0, prompt - cached, cached


def suite_steady(client: Client, text: str, model: str, prompt_tokens: int, max_tokens: int,
                 duration: float, warmup: int) -> dict:
    offset = 0

    def request() -> dict:
        nonlocal offset
        # A fresh window of the text each time, calibrated to prompt_tokens before the clock runs.
        p = calibrate(client, text, offset, prompt_tokens)
        offset = (offset + len(p)) % max(1, len(text) - 2 * len(p))
        return client.stream("/v1/completions", {"model": model, "prompt": p, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True, "cache_prompt": False})

    for _ in range(warmup):
        request()
    rows = []
    while sum(x["latency_s"] for x in rows) < duration:
        r = request()
        t = r["timings"] or {}
        rows.append({"latency_s": r["latency"], "ttft_s": r["ttft"], "prompt_tokens": r["usage"].get("prompt_tokens", 0),
                     "completion_tokens": r["usage"].get("completion_tokens", 0),
                     "prompt_n": t.get("prompt_n"), "prompt_ms": t.get("prompt_ms"),
                     "predicted_n": t.get("predicted_n"), "predicted_ms": t.get("predicted_ms")})
    elapsed = sum(x["latency_s"] for x in rows)  # time spent in requests (calibration excluded)
    p = sum(x["prompt_tokens"] for x in rows)
    c = sum(x["completion_tokens"] for x in rows)
    n = len(rows)
    return {"requests": n, "seconds": elapsed, "prompt_tokens": p, "completion_tokens": c,
            "prompt_tps": p / elapsed, "completion_tps": c / elapsed, "total_tps": (p + c) / elapsed,
            "mean_latency_s": sum(x["latency_s"] for x in rows) / n, "mean_ttft_s": sum(x["ttft_s"] for x in rows) / n,
            # The server's own figures (llama-server's timings), when it reports them.
            "server_prompt_tps": _rate(rows, "prompt_n", "prompt_ms"),
            "server_predicted_tps": _rate(rows, "predicted_n", "predicted_ms")}


def _rate(rows: list[dict], n: str, ms: str) -> float | None:
    if any(r[n] is None or r[ms] is None for r in rows):
        return None
    total_ms = sum(r[ms] for r in rows)
    return sum(r[n] for r in rows) / (total_ms / 1e3) if total_ms > 0 else None


def suite_prefill(client: Client, text: str, model: str, prompt_tokens: int, max_tokens: int) -> dict:
    # A nonce in front makes the prompt cold for any prompt cache; cache_prompt=false for llama-server.
    nonce = f"# run {uuid.uuid4().hex}\n"
    prompt = calibrate(client, text, 0, max(1, prompt_tokens - client.count_tokens(nonce)))
    r = client.stream("/v1/completions", {"model": model, "prompt": nonce + prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True, "cache_prompt": False})
    tps, processed, cached = _prompt_tps(r)
    return {"prompt_tokens": r["usage"].get("prompt_tokens", processed + cached), "processed_tokens": processed,
            "cached_tokens": cached, "completion_tokens": r["usage"].get("completion_tokens", 0),
            "latency_s": r["latency"], "ttft_s": r["ttft"], "prompt_tps": tps,
            "predicted_tps": (r["timings"] or {}).get("predicted_per_second")}


def suite_turns(client: Client, text: str, model: str, turn_tokens: int, max_tokens: int, target_ctx: int) -> dict:
    messages = [{"role": "system", "content": "You continue Python code."}]
    rows, offset, context = [], 0, 0
    while context + turn_tokens + max_tokens <= target_ctx:
        user = calibrate(client, text, offset, turn_tokens)
        offset += len(user)
        messages.append({"role": "user", "content": user})
        r = client.stream("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True, "cache_prompt": True})
        messages.append({"role": "assistant", "content": r["text"]})
        tps, processed, cached = _prompt_tps(r)
        context = int(r["usage"].get("prompt_tokens", processed + cached)) + int(r["usage"].get("completion_tokens", 0))
        rows.append({"turn": len(rows) + 1, "prompt_tokens": processed + cached, "processed": processed,
                     "cached": cached, "completion_tokens": r["usage"].get("completion_tokens", 0),
                     "latency_s": r["latency"], "ttft_s": r["ttft"], "prompt_tps": tps})
    if not rows:
        raise ExpertCacheError(f"--target-ctx {target_ctx} leaves no room for one turn of {turn_tokens} "
                               f"tokens plus {max_tokens} generated")
    return {"turns": len(rows), "final_context": context,
            "mean_latency_s": sum(x["latency_s"] for x in rows) / len(rows),
            "processed_tokens": sum(x["processed"] for x in rows), "cached_tokens": sum(x["cached"] for x in rows),
            "mean_prompt_tps": sum(x["prompt_tps"] for x in rows) / len(rows), "rows": rows}


def run_suite(args, url: str) -> dict:
    client = Client(url, args.timeout)
    text, label = bench_text()
    models = client.get("/v1/models").get("data") or [{}]
    model = args.model_id or models[0].get("id")
    max_tokens = args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS[args.suite]
    if args.suite == "steady":
        res = suite_steady(client, text, model, args.prompt_tokens or 512, max_tokens, args.duration, args.warmup)
    elif args.suite == "prefill":
        res = suite_prefill(client, text, model, args.prompt_tokens or 2048, max_tokens)
    else:
        res = suite_turns(client, text, model, args.turn_tokens, max_tokens, args.target_ctx)
    res.update(_scrape_ours(client))
    return {"suite": args.suite, "url": url, "model": model, "text": label, "max_tokens": max_tokens, **res}


# Our server's gauges (since start) that the results carry, when the server is ours.
SCRAPED = {"expertcache_cache_hit_rate": "cache_hit_rate",
           "expertcache_prefill_bytes_read_per_token": "prefill_bytes_read_per_token"}


def _scrape_ours(client: Client) -> dict:
    out = {}
    try:
        with client._open("/metrics") as r:
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name in SCRAPED:
                    out[SCRAPED[name]] = float(value)
    except (ExpertCacheError, ValueError):
        pass
    return out


# ---- output ----
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)


def print_table(rows: list[dict], out=None) -> None:
    if not rows:
        return
    out = out or sys.stdout
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=out)
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)), file=out)


def print_result(res: dict) -> None:
    print(f"suite {res['suite']} | {res['url']} | model {res['model']} | text: {res['text']}")
    scalars = {k: v for k, v in res.items() if k not in ("suite", "url", "model", "text", "rows")}
    if res.get("rows"):
        print_table(res["rows"])
    print_table([{"metric": k, "value": v} for k, v in scalars.items()])


# ---- A/B: our server in each cache mode ----
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(args, mode: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "expertcache.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
            "--port", str(port), "--cache-mode", mode, "--cache-policy", args.cache_policy, "--store", args.store,
            "--ubatch", str(args.ubatch), "--device", args.device, "--kernels", args.kernels,
            "--activations", args.activations, "--prefill-stretch", str(args.prefill_stretch)]
    if mode == "cache":
        argv += ["--prefetch", args.prefetch, "--prefetch-width", str(args.prefetch_width),
                 "--prefetch-min-prob", str(args.prefetch_min_prob)]
        for flag, v in (("--cache-experts", args.cache_experts), ("--cache-mem", args.cache_mem),
                        ("--cache-fraction", args.cache_fraction), ("--predictor", args.predictor)):
            if v is not None:
                argv += [flag, str(v)]
    for flag, v in (("-t", args.threads), ("-c", args.ctx_size), ("--dtype", args.dtype),
                    ("--prefill-mem", args.prefill_mem)):
        if v is not None:
            argv += [flag, str(v)]
    if args.cache_verify:
        argv.append("--cache-verify")
    return argv


def run_compare(args) -> list[dict]:
    from ..config import CACHE_MODES

    modes = [m.strip() for m in args.compare.split(",") if m.strip()]
    bad = [m for m in modes if m not in CACHE_MODES]
    if bad or len(modes) < 1:
        raise ExpertCacheError(f"--compare {args.compare!r}: expected cache modes from {', '.join(CACHE_MODES)}")
    # The results and the deltas are keyed by mode: a mode given twice was measured twice, printed
    # twice, and kept once in the JSON line.
    twice = sorted({m for m in modes if modes.count(m) > 1})
    if twice:
        raise ExpertCacheError(f"--compare {args.compare!r}: {', '.join(twice)} given more than once; "
                               "name each mode once")
    results = []
    for mode in modes:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        try:
            with tempfile.TemporaryFile() as log:
                proc = subprocess.Popen(serve_argv(args, mode, port), stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
                try:
                    _wait_healthy(url, proc, log, args.startup_timeout)
                    res = run_suite(args, url)
                finally:
                    proc.terminate()
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        except ExpertCacheError as e:
            # The other modes still run and print: a mode that fails is reported, not the end of the run.
            print(f"mode {mode} failed: {e}")
            print()
            results.append({"mode": mode, "error": str(e)})
            continue
        res["mode"] = mode
        print_result(res)
        print()
        results.append(res)
    return results


def _wait_healthy(url: str, proc: subprocess.Popen, log, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            raise ExpertCacheError(f"the server exited with code {proc.returncode}: {' | '.join(tail)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise ExpertCacheError(f"the server at {url} was not healthy after {timeout:.0f} s (--startup-timeout)")


def deltas(results: list[dict]) -> list[dict]:
    """Each numeric figure of every mode against the first (the control), as a relative change."""
    base = results[0]
    rows = []
    for k, v in base.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or k == "max_tokens":
            continue
        row = {"metric": k}
        for r in results:
            row[r["mode"]] = r.get(k)
        for r in results[1:]:
            x = r.get(k)
            row[f"{r['mode']} vs {base['mode']}"] = f"{(x / v - 1) * 100:+.1f}%" if v and isinstance(x, int | float) else "-"
        rows.append(row)
    return rows


# ---- command ----
def cmd_bench_serve(args) -> int:
    from ..flags import json_line

    if (args.url is None) == (args.model is None):
        raise ExpertCacheError("give exactly one of --url URL (a running server) or --model DIR (with --compare)")
    if args.duration <= 0 or args.warmup < 0 or args.timeout <= 0:
        raise ExpertCacheError(f"--duration {args.duration} and --timeout {args.timeout} must be > 0, "
                               f"--warmup {args.warmup} must be >= 0")
    if args.model is not None and not args.compare:
        args.compare = "cache"
    if args.url is not None:
        res = run_suite(args, args.url)
        print_result(res)
        print(json_line(res))
        return 0
    measured = run_compare(args)
    failed = [r for r in measured if "error" in r]
    results = [r for r in measured if "error" not in r]
    if not results:  # nothing measured: one line, as before
        raise ExpertCacheError(failed[0]["error"])
    rows = deltas(results)
    if len(results) > 1:
        print(f"deltas ({results[0]['mode']} is the control)")
        print_table(rows)
    print(json_line({"suite": args.suite, "text": results[0]["text"], "modes": {r["mode"]: r for r in results},
                     "failed": failed, "deltas": rows}))
    return 1 if failed else 0


def _server_url(text: str) -> str:
    """`--url`: a server's base URL, http:// or https:// with a host ('notaurl' was a ValueError
    traceback from urllib at the first request)."""
    import argparse
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not a server URL: expected http://HOST:PORT or "
                                         "https://HOST[:PORT]")
    return text


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (NaN ran for no time, -1 started a server and gave up)."""
    import argparse

    from ..flags import finite_float

    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text} seconds: expected a positive number")
    return v


def add_parser(suites) -> None:
    from ..flags import add_cache_flags, add_kernels_flag, add_prefill_flags, dtype_name, nonneg_int, positive_int, \
        threads

    p = suites.add_parser("serve", help="measure an OpenAI-compatible server: steady, prefill or turns")
    p.add_argument("--suite", choices=SUITE_NAMES, required=True,
                   help="steady: requests one after another for --duration; prefill: one cold request of "
                        "--prompt-tokens; turns: one conversation growing to --target-ctx")
    p.add_argument("--url", type=_server_url, help="a running server, e.g. http://127.0.0.1:8080")
    p.add_argument("--model-id", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--prompt-tokens", type=positive_int,
                   help="prompt tokens per request (steady: default 512; prefill: default 2048)")
    p.add_argument("--max-tokens", type=positive_int, help="tokens generated per request (default: 128; turns: 64)")
    p.add_argument("--duration", type=_seconds, default=60.0, help="steady: seconds of measured requests (default: 60)")
    p.add_argument("--warmup", type=nonneg_int, default=1, help="steady: requests before measuring (default: 1)")
    p.add_argument("--turn-tokens", type=positive_int, default=256, help="turns: user tokens per turn (default: 256)")
    p.add_argument("--target-ctx", type=positive_int, default=2048, help="turns: context to grow to (default: 2048)")
    p.add_argument("--timeout", type=_seconds, default=600.0, help="seconds per request (default: 600)")
    g = p.add_argument_group("A/B: start our server in each mode (instead of --url)")
    g.add_argument("-m", "--model", help="model directory to serve")
    g.add_argument("--compare", help="cache modes to serve in turn, the first is the control (e.g. staging,cache)")
    g.add_argument("-t", "--threads", type=threads, help="CPU threads of the server (the same in every mode)")
    g.add_argument("-c", "--ctx-size", type=positive_int, help="context of the server's slot")
    g.add_argument("--dtype", type=dtype_name,
                   help="compute dtype: float32, bfloat16 or float16 (default: the checkpoint's)")
    add_kernels_flag(g)
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument("--ubatch", type=positive_int, default=512, help="prefill micro-batch size (default: 512)")
    add_prefill_flags(g)
    g.add_argument("--startup-timeout", type=_seconds, default=300.0, help="seconds to wait for /health (default: 300)")
    add_cache_flags(p)
    p.set_defaults(func=cmd_bench_serve)
