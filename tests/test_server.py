"""The OpenAI-compatible server: the official `openai` client against a real socket server, the
prompt cache (reuse is counted and changes no output), slots, disconnects, OpenAI's error shape
for bad input, /metrics, and the `bench serve` client."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

import expertcache
from expertcache import CacheConfig, cli
from expertcache.server.app import create_app
from expertcache.server.slots import Slot, choose_slot
from conftest import LiveServer, wait_until

CTX = 384
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from conftest import build_reference, save_checkpoint, tiny_config

    ref = build_reference(tiny_config("qwen3_moe"), seed=0)
    return save_checkpoint(ref, tmp_path_factory.mktemp("server") / "tiny-moe")


@pytest.fixture(scope="module")
def ref(ckpt):
    """A model of its own for reference outputs: a served model belongs to its worker thread."""
    return expertcache.load(ckpt, ctx_size=CTX)


@pytest.fixture(scope="module")
def live(ckpt):
    model = expertcache.load(ckpt, ctx_size=CTX)
    srv = LiveServer(create_app(model, n_slots=2))
    srv.model, srv.id = model, ckpt.name
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def chat_msgs(*words):
    return [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": " ".join(words)}]


# ---- status and tokens ----
def test_health_models_tokenize(live):
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        assert c.get("/health").json() == {"status": "ok"}
        models = c.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == live.id
        toks = c.post("/tokenize", json={"content": "w1 w2 w3"}).json()["tokens"]
        assert toks == [5, 6, 7]
        assert c.post("/detokenize", json={"tokens": toks}).json() == {"content": "w1 w2 w3"}


# ---- the openai client ----
def test_openai_chat_and_completion(live, oai, ref):
    msgs = chat_msgs("w7", "w9", "w11")
    r = oai.chat.completions.create(model=live.id, messages=msgs, max_tokens=8, temperature=0)
    want = ref.chat(msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == live.id
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert {"prompt_n", "cache_n", "predicted_n", "prompt_per_second", "predicted_per_second"} <= set(timings)
    assert timings["prompt_n"] + timings["cache_n"] == want.prompt_tokens

    c = oai.completions.create(model=live.id, prompt="w5 w9 w17", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    want = ref.generate("w5 w9 w17", max_tokens=6, temperature=0, ignore_eos=True)
    assert c.object == "text_completion" and c.choices[0].text == want.text
    assert c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "length"


def test_openai_streaming(live, oai, ref):
    msgs = chat_msgs("w20", "w21")
    stream = oai.chat.completions.create(model=live.id, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.chat(msgs, max_tokens=10, temperature=0, ignore_eos=True).text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    pieces = [ch.choices[0].text for ch in oai.completions.create(
        model=live.id, prompt="w8 w8 w9", max_tokens=7, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(pieces) == ref.generate("w8 w8 w9", max_tokens=7, temperature=0, ignore_eos=True).text

    # The raw stream: server-sent events ending with [DONE]; no usage unless asked for.
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        body = {"prompt": "w1 w2", "max_tokens": 3, "temperature": 0, "stream": True}
        lines = [ln for ln in c.post("/v1/completions", json=body).text.splitlines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert not any("usage" in json.loads(ln[6:]) for ln in lines[:-1])


# ---- the prompt cache ----
def _clear_prefix(ref, prompt_ids: list[int], out_ids: list[int], margin: float = 1e-3) -> int:
    """How many generated tokens the reference picks with a clear top-2 margin."""
    logits = ref.logits(prompt_ids + out_ids)[len(prompt_ids) - 1:]
    top2 = logits.topk(2, dim=-1).values
    for i, (a, b) in enumerate(top2.tolist()[: len(out_ids)]):
        if a - b < margin:
            return i
    return len(out_ids)


def test_prompt_cache_reuses_and_changes_nothing(live, ckpt, ref):
    off = expertcache.load(ckpt, ctx_size=CTX)
    from fastapi.testclient import TestClient

    turns = [["w10", "w11", "w12"], ["w13", "w14"], ["w15", "w16", "w17", "w18"]]
    results = {}
    with TestClient(create_app(off, n_slots=1, cache_prompt=False)) as nocache, \
            httpx.Client(base_url=live.url, timeout=TIMEOUT) as cached:
        for name, client in (("on", cached), ("off", nocache)):
            msgs, out = [{"role": "system", "content": "w3 w4 w5"}], []
            for words in turns:
                msgs.append({"role": "user", "content": " ".join(words)})
                r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "temperature": 0,
                                                              "ignore_eos": True}).json()
                text = r["choices"][0]["message"]["content"]
                out.append((ref.tokenizer.encode_chat(msgs), text, r["timings"], r["usage"]))
                msgs.append({"role": "assistant", "content": text})
            results[name] = out
    for i, ((ids, on_text, on_t, on_u), (_, off_text, off_t, _)) in enumerate(zip(results["on"], results["off"])):
        assert off_t["cache_n"] == 0 and off_t["prompt_n"] == len(ids)
        assert on_t["prompt_n"] + on_t["cache_n"] == len(ids)
        assert on_u["prompt_tokens_details"]["cached_tokens"] == on_t["cache_n"]
        if i > 0:  # the conversation so far is reused
            assert on_t["cache_n"] >= len(results["on"][i - 1][0])
        # Greedy text agrees wherever the reference's top-2 margin is clear.
        on_ids, off_ids = ref.tokenizer.encode(on_text, False), ref.tokenizer.encode(off_text, False)
        n = _clear_prefix(ref, ids, off_ids)
        assert on_ids[:n] == off_ids[:n]
        assert n >= len(off_ids) // 2, "the reference has too many near-ties for this test"


def test_prompt_cache_logits_within_1e4(ref):
    a = [5, 9, 17, 33, 60, 7, 8, 9, 100, 101, 12, 14]
    b = a[:8] + [40, 41, 42, 43, 44, 45]
    s = ref.new_session()
    ref.prefill(s, a)
    s.truncate(8)  # what generate(..., session=s) keeps of `a` for `b`
    reused = ref.prefill(s, b[8:], all_logits=True)
    fresh = ref.logits(b)[8:]
    assert (reused - fresh).abs().max().item() <= 1e-4


# ---- slots ----
def _slot(i, tokens, last_used):
    return Slot(i, SimpleNamespace(tokens=list(tokens)), last_used)


def test_choose_slot():
    conv = [2, 10, 11, 3, 2, 12, 13, 14, 15, 16, 3]
    slots = [_slot(0, conv, 5), _slot(1, [], 0), _slot(2, [2, 10, 99, 98, 97], 3)]
    assert choose_slot(slots, conv + [2, 20, 21]).id == 0          # continues slot 0's conversation
    assert choose_slot(slots, [2, 10, 40, 41, 42, 43, 44, 45]).id == 1  # a shared opening only: LRU (empty) slot
    assert choose_slot(slots, [2, 10, 99, 1]).id == 2
    assert choose_slot(slots, conv, cache_prompt=False).id == 1    # no prompt cache: least recently used


def test_requests_total_counts_aborted_and_failed_requests():
    # `requests_total` holds its parts: a request dropped in the queue or failing in the engine
    # counts there as well as in `aborted` / `failed` (else aborted could exceed requests).
    from expertcache.server.slots import Job, Scheduler

    def generate(ids, session, **kw):
        raise RuntimeError("boom")

    model = SimpleNamespace(new_session=lambda: SimpleNamespace(tokens=[], truncate=lambda n: None),
                            generate=generate)
    sched = Scheduler(model, n_slots=1)
    done = []
    left, failing = Job([1, 2], {}), Job([1, 2], {})
    left.cancelled.set()  # its client left while it was queued
    for job in (left, failing):
        job.on_done = lambda res, err: done.append(err)
        sched.submit(job)
    sched.start()
    try:
        wait_until(lambda: len(done) == 2, "the worker did not take both jobs")
    finally:
        sched.stop()
    s = sched.snapshot()
    assert (s.requests, s.aborted, s.errors) == (2, 1, 1)


def test_scheduler_stop_ends_running_queued_and_later_jobs_with_a_503():
    # At shutdown every job ends with an error the API answers as 503 `server_shutting_down`: the
    # running one at its next token, the queued one unrun, one submitted afterwards at once.
    from expertcache.engine import GenerationResult
    from expertcache.server.app import _error_of
    from expertcache.server.slots import Job, Scheduler

    running, tokens = threading.Event(), []

    def generate(ids, session, on_text=None, should_stop=None, **kw):
        running.set()
        deadline = time.monotonic() + TIMEOUT
        while on_text("w1") and time.monotonic() < deadline:  # one token after another until told to stop
            tokens.append(1)
        return GenerationResult("", list(tokens), len(ids), 0, "abort", 0.0, 0.0)

    model = SimpleNamespace(new_session=lambda: SimpleNamespace(tokens=[], truncate=lambda n: None),
                            generate=generate)
    sched = Scheduler(model, n_slots=1)
    done = {}
    jobs = {name: Job([1, 2], {}) for name in ("running", "queued", "later")}
    for name, job in jobs.items():
        job.on_done = lambda res, err, name=name: done.setdefault(name, (res, err))
    sched.start()
    worker = sched._thread
    sched.submit(jobs["running"])
    wait_until(running.is_set, "the worker did not start the job")
    sched.submit(jobs["queued"])
    sched.stop()
    assert not worker.is_alive(), "the worker did not end"
    sched.submit(jobs["later"])
    assert set(done) == {"running", "queued", "later"}
    for name, (res, err) in done.items():
        assert res is None and err is not None, name
        e = _error_of(err)
        assert e.status == 503 and e.code == "server_shutting_down", (name, e.status, e.message)
        assert "shutting down" in e.body()["error"]["message"]
    s = sched.snapshot()
    assert (s.processing, s.deferred) == (0, 0)


def _sse_data(lines: list[str]) -> list:
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


def test_ctrl_c_ends_streams_and_queued_requests_cleanly(ckpt, tmp_path):
    # `expertcache serve` gets SIGINT while a stream runs, one request waits behind it and the web
    # page's event stream is open: the queued request is a 503 with OpenAI's error body, the stream
    # ends with an error event and [DONE], and the process exits at once, without a traceback
    # (before: uvicorn's 5 s grace period, then a plain-text 500, a cut stream and CancelledError
    # tracebacks).
    log = tmp_path / "serve.log"
    with open(log, "w") as err:  # a file, not a pipe: a server that logs a lot cannot block on it
        # A context far beyond the model's 512 positions: the stream would run for many seconds.
        proc = subprocess.Popen([sys.executable, "-m", "expertcache.cli", "serve", "-m", str(ckpt), "--port", "0",
                                 "-c", "8192", "-t", "1"], stderr=err, stdout=subprocess.DEVNULL)
    threads, out = [], {"stream": [], "events": []}
    try:
        wait_until(lambda: "serving" in log.read_text() or proc.poll() is not None, "the server did not start")
        assert proc.poll() is None, log.read_text()
        url = log.read_text().split(" on ", 1)[1].split()[0]

        def stream():
            body = {"prompt": "w1 w2 w3", "max_tokens": 8000, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                out["stream_status"] = r.status_code
                out["stream"].extend(ln for ln in r.iter_lines() if ln)  # appended one by one

        def queued():
            out["queued"] = httpx.post(url + "/v1/completions", json={"prompt": "w1", "max_tokens": 4},
                                       timeout=TIMEOUT)

        def events():
            with httpx.stream("GET", url + "/cache/events", timeout=TIMEOUT) as r:
                out["events"].extend(ln for ln in r.iter_lines() if ln)

        for fn in (stream, events):
            threads.append(threading.Thread(target=fn, daemon=True))
            threads[-1].start()
        wait_until(lambda: out["stream"] and out["events"], "the streams did not begin")
        threads.append(threading.Thread(target=queued, daemon=True))
        threads[-1].start()
        wait_until(lambda: httpx.get(url + "/cache/state", timeout=TIMEOUT).json()["server"]["deferred"] == 1,
                   "the second request was not queued")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(TIMEOUT)
        took = time.monotonic() - t0
        for t in threads:
            t.join(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI" not in text, text
    assert rc in (130, 0), (rc, text)  # 130: as any Ctrl-C of the CLI (0 where SIGINT was ignored)
    assert took < 4.0, f"the server took {took:.1f}s to exit"  # uvicorn's grace period is 5 s

    r = out["queued"]
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "shutting down" in r.json()["error"]["message"]

    data = _sse_data(out["stream"])
    assert out["stream_status"] == 200 and data[-1] == "[DONE]", out["stream"][-3:]
    assert data[-2]["error"]["code"] == "server_shutting_down", data[-2]
    assert len(data) - 2 < 8000  # cut short: no finish chunk
    assert all("choices" in d for d in data[:-2])


def test_concurrent_clients_all_answered(live, ref):
    prompts = [f"w{30 + i} w{40 + i} w{50 + i}" for i in range(5)]
    answers: dict[int, str] = {}

    def ask(i):
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})
            answers[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(answers) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        assert answers[i] == ref.generate(p, max_tokens=8, temperature=0, ignore_eos=True).text


def test_disconnect_stops_generation_and_frees_the_slot(live):
    sched = live.app.state.scheduler
    before = sched.snapshot()
    max_tokens = CTX - 8
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        body = {"prompt": "w1 w2 w3", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    wait_until(lambda: sched.snapshot().aborted != before.aborted, "the generation was not stopped")
    after = sched.snapshot()
    assert after.predicted_tokens - before.predicted_tokens < max_tokens
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:  # the slot serves the next request
        r = c.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    metrics = httpx.get(live.url + "/metrics", timeout=TIMEOUT).text
    assert f"expertcache_requests_aborted_total {float(after.aborted)}" in metrics

    # A non-streaming client that gives up is noticed too.
    body = {"prompt": "w1 w2 w3", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.05)
    wait_until(lambda: sched.snapshot().aborted != after.aborted, "the generation was not stopped")
    assert sched.snapshot().predicted_tokens - after.predicted_tokens < max_tokens + 2


# ---- bad input ----
BAD = [
    ("/v1/chat/completions", b"{", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "w1"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w1"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "top_p": -0.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 " * (CTX + 10)}]}, 400, "messages"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": "w1"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w1 " * (CTX + 1)}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w1", "stop": 3}, 400, "stop"),
    ("/tokenize", {"content": 3}, 400, "content"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "w1"}]}, 404, "model"),
    ("/v1/completions", {"model": "other", "prompt": "w1"}, 404, "model"),
]


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(live, oai):
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        for path, body, status, param in BAD:
            kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            r = c.post(path, **kw)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
            if status == 404:
                assert err["code"] == "model_not_found"
            if not isinstance(body, bytes) and "w1 w1 w1" in json.dumps(body):
                assert err["code"] == "context_length_exceeded"
            assert c.get("/health").status_code == 200
        r = c.get("/no/such/route")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "w1"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=live.id, messages=[], max_tokens=2)
    r = oai.chat.completions.create(model=live.id, messages=[{"role": "user", "content": "w1"}], max_tokens=2)
    assert r.choices[0].message.content is not None


# ---- metrics ----
def test_metrics_counters_survive_a_resize(live, oai):
    from prometheus_client.parser import text_string_to_metric_families

    oai.completions.create(model=live.id, prompt="w5 w6 w7", max_tokens=4, temperature=0)

    def scrape() -> dict:
        text = httpx.get(live.url + "/metrics", timeout=TIMEOUT).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = (fam.type, s.value)
        return out

    m = scrape()
    hits = m[("expertcache_cache_resident_hits_total", (("layer", "0"),))]
    assert hits[0] == "counter" and hits[1] > 0
    assert ("expertcache_cache_invalidations_total", (("reason", "pool"),)) in m
    assert m[("expertcache_tokens_predicted_total", ())][1] > 0
    assert m[("expertcache_prompt_tokens_total", ())][1] > 0
    assert ("expertcache_predicted_tokens_per_second", ()) in m

    sched = live.app.state.scheduler
    # The worker is idle before a resize.
    wait_until(lambda: not (sched.snapshot().processing or sched.snapshot().deferred), "the worker stayed busy")
    live.model.resize_cache(CacheConfig(mode="cache", fraction=0.5))
    oai.completions.create(model=live.id, prompt="w5 w6 w7", max_tokens=4, temperature=0)
    m2 = scrape()
    for key, (kind, value) in m.items():
        if kind == "counter" and key in m2:
            assert m2[key][1] >= value, key
    pool = ("expertcache_cache_invalidations_total", (("reason", "pool"),))
    assert m2[pool][1] > m[pool][1]
    assert m2[("expertcache_cache_resident_misses_total", (("layer", "0"),))][1] > 0


# ---- command line ----
def test_serve_busy_port_is_one_line_error(ckpt, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert cli.main(["serve", "-m", str(ckpt), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


@pytest.mark.parametrize("alias", ["", "  "])
def test_serve_empty_alias_is_one_line_error(ckpt, capsys, alias):
    assert cli.main(["serve", "-m", str(ckpt), "--port", "0", "--alias", alias]) == 2
    err = capsys.readouterr().err
    assert "--alias" in err and err.count("\n") == 1


def _bench(args) -> tuple[str, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["bench", "serve", *args]) == 0
    text = out.getvalue()
    return text, json.loads(text.strip().splitlines()[-1])


def test_bench_serve_suites(live):
    text, res = _bench(["--url", live.url, "--suite", "turns", "--turn-tokens", "24", "--max-tokens", "6",
                        "--target-ctx", "120"])
    assert "text: " in text and res["suite"] == "turns" and res["turns"] >= 2
    rows = res["rows"]
    assert all(b["cached"] >= a["prompt_tokens"] for a, b in itertools.pairwise(rows))  # the conversation is reused
    assert all(r["processed"] < r["prompt_tokens"] for r in res["rows"][1:])

    _, res = _bench(["--url", live.url, "--suite", "prefill", "--prompt-tokens", "100", "--max-tokens", "4"])
    assert abs(res["prompt_tokens"] - 100) <= 3 and res["cached_tokens"] == 0 and res["completion_tokens"] == 4

    _, res = _bench(["--url", live.url, "--suite", "steady", "--prompt-tokens", "40", "--max-tokens", "4",
                     "--duration", "0.5", "--warmup", "1"])
    assert res["requests"] >= 1 and res["completion_tokens"] == 4 * res["requests"]
    assert res["total_tps"] > 0 and res["mean_latency_s"] > 0


def test_bench_serve_compare_starts_our_server_in_each_mode(ckpt):
    text, res = _bench(["-m", str(ckpt), "--compare", "staging,cache", "--cache-fraction", "0.5", "-t", "1",
                        "-c", "256", "--suite", "prefill", "--prompt-tokens", "64", "--max-tokens", "4",
                        "--startup-timeout", "120"])
    assert set(res["modes"]) == {"staging", "cache"} and "deltas (staging is the control)" in text
    assert res["modes"]["staging"]["cache_hit_rate"] == 0.0 and res["modes"]["cache"]["cache_hit_rate"] > 0
    assert {r["metric"] for r in res["deltas"]} >= {"latency_s", "prompt_tps"}
