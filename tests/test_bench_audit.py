"""What the benchmark commands print, checked against references: the time split of `bench
speed` against the cache's copy time, the runs its flags allow, and how `bench serve` and
`bench cache` report a server or a configuration that fails."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import expertcache
from expertcache import CacheConfig
from expertcache.cli import main
from expertcache.models.synth import synth
from conftest import assert_one_line_error, run_cli

# Gemma 4's layer kinds and GeGLU experts beside a dense MLP, at a size that loads in a blink.
SMALL_GEMMA4 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                    num_global_key_value_heads=1, intermediate_size=64, moe_intermediate_size=32, sliding_window=16,
                    max_position_embeddings=4096)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("audit")
    return {"qwen3": synth(d / "q", like="tiny", layers=2, experts=16, top_k=4, vocab=300, dtype="float32",
                           progress=False),
            "gemma4": synth(d / "g", like="gemma-4-26b-a4b", layers=2, experts=8, top_k=2, vocab=300,
                            dtype="float32", progress=False, overrides=SMALL_GEMMA4)}


# ---- bench speed -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "gemma4"])
def test_bench_speed_charges_the_copies_to_copies_wherever_they_fall(models, monkeypatch, arch):
    """On a clock that moves only while the store copies (one second a copy), the decode split's
    `copies` is the cache's copy time per token and every other part is zero. Gemma 4's dense MLP
    runs as the op's `meanwhile`, after the op's copies: its lap held them, and `experts`, less
    every copy, went below zero (-16 ms of a 20 ms step in a staging run)."""
    from expertcache.bench.speed import _decode

    torch.set_num_threads(1)
    model = expertcache.load(models[arch], cache=CacheConfig(mode="staging", store="ram"))
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    store = model.experts.store
    copy_run = store.copy_run

    def timed_copy(*args):
        clock[0] += 1.0
        return copy_run(*args)

    monkeypatch.setattr(store, "copy_run", timed_copy)
    before = model.telemetry()["copy_seconds"]
    prompt, n = list(range(10, 26)), 3
    copied_before_decode = []
    prefill = model.prefill

    def mark(session, tokens, *a, **k):  # the copy time when the timed steps begin
        if len(tokens) > 1:
            out = prefill(session, tokens, *a, **k)
            copied_before_decode.append(model.telemetry()["copy_seconds"])
            return out
        return prefill(session, tokens, *a, **k)

    monkeypatch.setattr(model, "prefill", mark)
    d = _decode(model, prompt, n)
    copies = model.telemetry()["copy_seconds"] - copied_before_decode[0]
    assert copies > 0 and copied_before_decode[0] > before  # staging copies in every op
    split = d["split_ms"]
    assert split["copies"] == pytest.approx(1e3 * copies / n)
    assert d["ms_per_token"] == pytest.approx(1e3 * copies / n)
    others = {k: v for k, v in split.items() if k != "copies"}
    assert others == pytest.approx(dict.fromkeys(others, 0.0), abs=1e-9), split
    if arch == "gemma4":
        assert "dense_mlp" in split


def test_bench_speed_runs_with_fewer_decode_steps_than_it_profiles(models, capsys, monkeypatch):
    """`--prefill 4 --decode 2`, flags it accepts, measured every mode and then failed in the
    resident mode's profiled decode (64 prompt tokens and 16 steps, over the context of 78)."""
    from expertcache.bench import speed

    # The machine's rates on small buffers: this test looks at what runs, not at the rates.
    read, copy = speed.measure_read_bandwidth, speed.measure_copy_bandwidth
    monkeypatch.setattr(speed, "measure_read_bandwidth", lambda threads: read(threads, 1 << 22))
    monkeypatch.setattr(speed, "measure_copy_bandwidth", lambda: copy(1 << 22))
    assert main(["bench", "speed", "-m", str(models["qwen3"]), "--prefill", "4", "--decode", "2",
                 "--fractions", "0.5", "--pairs", "1", "-t", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["mode"] for r in out["results"]] == ["resident", "cache", "staging"]
    assert out["results"][0]["overhead"]["step_ms"] > 0


# ---- bench serve -------------------------------------------------------------------------------


class _Server:
    """An OpenAI-compatible stand-in: /v1/models, /tokenize (4 characters a token), streamed
    completions of two pieces, /metrics; `broken` cuts the completion's stream off mid-chunk (a
    server that died), `not_json` answers HTML."""

    def __init__(self):
        self.broken = self.not_json = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, body: bytes, kind="application/json"):
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if server.not_json:
                    return self._send(b"<html>a web page</html>", "text/html")
                if self.path == "/metrics":
                    return self._send(b"expertcache_cache_hit_rate 0.5\n", "text/plain")
                self._send(json.dumps({"data": [{"id": "m"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    return self._send(json.dumps({"tokens": [0] * max(1, len(body["content"]) // 4)}).encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                usage = {"prompt_tokens": len(body["prompt"]) // 4, "completion_tokens": 2}
                events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "length"}],
                                                          "usage": usage}]
                for i, e in enumerate(events):
                    data = f"data: {json.dumps(e)}\n\n".encode()
                    if server.broken and i == 1:
                        self.wfile.write(b"%x\r\n%s" % (len(data), data[:10]))  # cut short
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_bench_serve_says_in_one_line_when_the_server_is_not_an_api(server, capsys):
    """A URL whose server answers HTML (a web page, not an OpenAI-compatible server) is one line
    naming the request (it was a JSONDecodeError traceback)."""
    server.not_json = True
    assert_one_line_error(*run_cli(capsys, "bench", "serve", "--url", server.url, "--suite", "prefill",
                                   "--prompt-tokens", "8", "--max-tokens", "2"),
                          f"{server.url}/v1/models", "not JSON")


def test_bench_serve_says_in_one_line_when_a_stream_breaks_off(server, capsys):
    server.broken = True
    assert_one_line_error(*run_cli(capsys, "bench", "serve", "--url", server.url, "--suite", "prefill",
                                   "--prompt-tokens", "8", "--max-tokens", "2"),
                          f"{server.url}/v1/completions", "broke off")


def test_bench_serve_compare_goes_on_when_a_modes_server_dies_mid_stream(server, monkeypatch, capsys, tmp_path):
    """The cache mode's server dies in the middle of its answer: that mode is reported failed and
    the others are measured (the broken stream was an http.client.IncompleteRead traceback that
    ended the run and lost the modes measured before it)."""
    from expertcache.bench import serve

    class Popen:
        def __init__(self, argv, **kw):
            server.broken = argv[argv.index("--cache-mode") + 1] == "cache"

        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.setattr(serve, "_wait_healthy", lambda url, proc, log, timeout: None)
    monkeypatch.setattr(serve, "_free_port", lambda: server.port)
    assert main(["bench", "serve", "-m", str(tmp_path), "--compare", "staging,cache,resident", "--suite", "prefill",
                 "--prompt-tokens", "8", "--max-tokens", "2"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out["modes"]) == ["staging", "resident"]
    assert [f["mode"] for f in out["failed"]] == ["cache"] and "broke off" in out["failed"][0]["error"]
    # each measured mode's figures are its request's: 2 tokens generated, the stand-in's usage
    assert all(r["completion_tokens"] == 2 and r["cache_hit_rate"] == 0.5 for r in out["modes"].values())


def test_bench_serve_compare_refuses_a_mode_given_twice_before_starting_a_server(monkeypatch, capsys, tmp_path):
    """`--compare cache,cache` measured twice and printed both, but the JSON line, keyed by mode,
    kept one of them and the deltas compared the mode with itself."""
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started a server"))
    assert_one_line_error(*run_cli(capsys, "bench", "serve", "-m", str(tmp_path), "--compare", "cache,staging,cache",
                                   "--suite", "prefill"), "--compare", "cache given more than once")


# ---- bench cache -------------------------------------------------------------------------------


def test_bench_cache_says_why_a_configuration_ended(models, capsys, monkeypatch):
    """A configuration's process killed by a signal (the OOM killer's SIGKILL) is reported as
    killed, not by the last line it printed before (a notice); one that ends without its figures
    is a failure of that configuration, not an IndexError that loses the others."""
    from expertcache.bench import cache_bench
    from test_bench import _measured

    def run(argv, **kw):
        spec = json.loads(argv[-1])
        if spec.get("fraction") == 0.25:
            return subprocess.CompletedProcess(argv, -9, "", "notice: the routers predict from now on\n")
        if spec.get("fraction") == 0.5:
            return subprocess.CompletedProcess(argv, 0, "", "")
        return subprocess.CompletedProcess(argv, 0, json.dumps(_measured(spec)) + "\n", "")

    monkeypatch.setattr(cache_bench.subprocess, "run", run)
    assert main(["bench", "cache", "-m", str(models["qwen3"]), "--stores", "ram", "--fractions", "0.25,0.5,0.75",
                 "--prefill", "4", "--decode", "4", "-t", "1"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert [(r["mode"], r["fraction"]) for r in out["results"]] == [("resident", None), ("staging", None), ("cache", 0.75)]
    assert [(f["fraction"], f["error"]) for f in out["failed"]] == [
        (0.25, "killed by SIGKILL"), (0.5, "no result: its last line of output is not the figures' JSON")]
    assert "failed: cache ram 25% prefetch auto: killed by SIGKILL" in lines


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_bench_cache_measures_the_prompt_from_empty_slots(models, fraction):
    """The warm-up runs the measured prompt's first tokens: their experts stayed in the slots, and
    the measured prefill counted as hits experts it never paid for (at 100% it read nothing for
    a short prompt). It must read what the same prompt reads on a model freshly loaded."""
    from expertcache.bench.cache_bench import run_one

    spec = {"model": str(models["qwen3"]), "mode": "cache", "fraction": fraction, "store": "ram", "threads": 1,
            "prefill": 12, "decode": 2, "ubatch": 512, "prefetch": "off"}
    row = run_one(spec)
    fresh = expertcache.load(models["qwen3"], cache=CacheConfig(mode="cache", fraction=fraction, store="ram",
                                                                prefetch="off"), ctx_size=32)
    prompt = torch.randint(0, fresh.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    before = fresh.telemetry()["total"]
    fresh.prefill(fresh.new_session(), prompt)
    after = fresh.telemetry()["total"]
    copied = after["copied_bytes"] - before["copied_bytes"]
    assert copied > 0
    assert row["prefill"]["copied_bytes_per_token"] * 12 == copied
    assert row["prefill"]["hit_rate"] == (after["resident_hits"] - before["resident_hits"]) / (
        after["used_experts_unique"] - before["used_experts_unique"])
