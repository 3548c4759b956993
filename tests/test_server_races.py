"""The server's lifecycle under races: a client that leaves at the edge of its stream, a worker that
meets an exception outside the generation, weights replaced by ones of another shape or rewritten
mid-stream, a copy that fails, an event stream open at shutdown, the queue's order and its gauge
when queued clients leave, and /metrics and /cache/state read mid-generation. Each race is pinned
with Events (a generation held at a token until the test lets it go); a condition another thread
makes true is polled with a deadline, never waited for with a sleep."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import threading

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

import expertcache
from conftest import LiveServer, build_reference, save_checkpoint, tiny_config, wait_until
from expertcache import CacheConfig
from expertcache.errors import CopyError
from expertcache.server import app as app_module
from expertcache.server.app import create_app
from expertcache.server.slots import Job, Scheduler

CTX = 256
TIMEOUT = 15.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path_factory.mktemp("races") / "m")


def wait_idle(sched: Scheduler) -> None:
    """Until the worker has nothing running or queued (TIMEOUT at most)."""
    wait_until(lambda: not (sched.snapshot().processing or sched.snapshot().deferred), "the worker stayed busy",
               TIMEOUT)


def hold_after_first_piece(model):
    """Make the model's generations stop after their first piece of text until `release` is set;
    `first` is set once that piece was handed on. Returns (first, release)."""
    first, release = threading.Event(), threading.Event()
    real = model.generate

    def generate(ids, on_text=None, **kw):
        def held(piece):
            go_on = on_text(piece)
            if not first.is_set():
                first.set()
                release.wait(TIMEOUT)
            return go_on

        return real(ids, on_text=held if on_text is not None else None, **kw)

    model.generate = generate
    return first, release


def asgi_request(app, path: str, body: dict, receive_after_body):
    """One request straight into the ASGI app (no socket): after the body, `receive` answers
    with `receive_after_body()`. Returns the messages the app sent."""
    raw = json.dumps(body).encode()
    sent, given = [], []

    async def receive():
        if not given:
            given.append(1)
            return {"type": "http.request", "body": raw, "more_body": False}
        return receive_after_body()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return sent


# ---- a client that leaves between its first piece and the stream's first byte ----
def test_a_stream_whose_client_left_before_its_first_byte_stops(ckpt, monkeypatch):
    # The client leaves while its prompt is processed, after the last check for that (every
    # DISCONNECT_POLL_S), and the first piece arrives: the stream begins with the client gone.
    # starlette cancels the stream as soon as it sees that; the generation must stop at its next
    # token rather than run on to max_tokens for nobody, holding the worker.
    monkeypatch.setattr(app_module, "DISCONNECT_POLL_S", 60.0)  # the poll falls outside the window
    model = expertcache.load(ckpt, ctx_size=CTX)
    first, release = hold_after_first_piece(model)
    max_tokens = 120
    with TestClient(create_app(model)) as client:
        sched = client.app.state.scheduler
        body = {"prompt": "w1 w2 w3", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            asgi_request(client.app, "/v1/completions", body, lambda: {"type": "http.disconnect"})
        finally:
            release.set()
        assert first.is_set()
        wait_idle(sched)
        s = sched.snapshot()
        assert s.aborted == 1 and s.predicted_tokens < max_tokens, s
        # The slot serves the next request.
        r = client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- an exception outside the generation ----
def test_the_worker_survives_a_failure_to_make_a_slots_session(ckpt, monkeypatch):
    # A slot's KV session is made on its first use, outside the generation's try: a failure there
    # (out of memory for another slot's context, say) ended the worker thread, and that request
    # and every later one waited forever. Now it is that request's 500 and the next is served.
    model = expertcache.load(ckpt, ctx_size=CTX)
    real, calls = model.new_session, []

    def new_session():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real()

    monkeypatch.setattr(model, "new_session", new_session)
    sched = Scheduler(model, n_slots=1)
    done = {name: threading.Event() for name in ("failing", "next")}
    out = {}
    jobs = {name: Job([5, 6, 7], {"max_tokens": 2, "ignore_eos": True}) for name in done}
    for name, job in jobs.items():
        def on_done(res, err, name=name):
            out[name] = (res, err)
            done[name].set()
        job.on_done = on_done
    sched.start()
    try:
        for job in jobs.values():
            sched.submit(job)
        assert done["failing"].wait(TIMEOUT), "the request whose session failed was never answered"
        assert done["next"].wait(TIMEOUT), "the worker did not serve the next request"
    finally:
        sched.stop()
    res, err = out["failing"]
    assert res is None and isinstance(err, torch.OutOfMemoryError)
    e = app_module._error_of(err)
    assert e.status == 500 and e.type == "server_error"
    res, err = out["next"]
    assert err is None and len(res.token_ids) == 2
    s = sched.snapshot()
    assert (s.requests, s.errors, s.processing, s.deferred) == (2, 1, 0, 0)


# ---- the weights change under the server ----
def _replace_atomically(src, dst):
    tmp = dst.with_suffix(".tmp")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


def test_weights_of_another_shape_do_not_poison_a_slot(ckpt, tmp_path):
    # The checkpoint is replaced by one with a fourth layer while the slot's session holds KV
    # buffers shaped for three. `generate` cut such a session back and reused its buffers, so the
    # request failed; the scheduler kept the session after the failure, and every later request on
    # the slot failed the same way: the server never served again. Now a session of old weights
    # gets new buffers, and a failed request's session is dropped in any case.
    work = tmp_path / "model"
    shutil.copytree(ckpt, work)
    deeper = save_checkpoint(build_reference(tiny_config("qwen3_moe", layers=4), seed=1), tmp_path / "deeper")
    body = {"prompt": "w3 w4 w5 w6", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with TestClient(create_app(expertcache.load(work, ctx_size=CTX), n_slots=1)) as client, \
            TestClient(create_app(expertcache.load(deeper, ctx_size=CTX), n_slots=1)) as fresh:
        assert client.post("/v1/completions", json=body).status_code == 200
        for name in ("model.safetensors", "config.json"):
            _replace_atomically(deeper / name, work / name)
        want = fresh.post("/v1/completions", json=body).json()["choices"][0]["text"]
        for _ in range(3):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want


def test_a_failed_copy_is_a_server_error_and_the_next_request_runs(ckpt):
    # A copy from the checkpoint that fails (an I/O error, a short read) is the server's failure,
    # not the client's: before the fix it was a 400 `invalid_request_error`, which tells an
    # OpenAI client not to retry a request that was fine.
    model = expertcache.load(ckpt, ctx_size=CTX, cache=CacheConfig(mode="cache", experts=3, store="disk"))
    body = {"prompt": "w3 w4 w5 w6", "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    def failing(n):
        raise CopyError(f"injected read failure at read {n}")

    with TestClient(create_app(model)) as client:
        want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        for stream in (False, True):
            model.experts.store.read_hook = failing
            try:
                r = client.post("/v1/completions", json={**body, "prompt": "w40 w41 w42 w43", "stream": stream})
            finally:
                model.experts.store.read_hook = None
            assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "injected read failure" in err["message"], err
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want



def test_logits_that_overflowed_are_a_server_error_and_the_next_request_runs(ckpt):
    # Logits holding NaN (an fp16 overflow in the forward) were a traceback's 500 while sampling
    # and, greedy, a NaN's position taken as the next token: garbage that looked like output.
    model = expertcache.load(ckpt, ctx_size=CTX)
    body = {"prompt": "w3 w4 w5 w6", "max_tokens": 3, "ignore_eos": True}
    real = model.net.forward

    def overflowing(*a, **kw):
        out = real(*a, **kw)
        return out.masked_fill(torch.arange(out.shape[-1]) == 5, float("nan"))

    with TestClient(create_app(model)) as client:
        want = client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        for temperature in (0, 1):
            model.net.forward = overflowing
            try:
                r = client.post("/v1/completions", json={**body, "temperature": temperature, "prompt": "w40 w41"})
            finally:
                model.net.forward = real
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "logits hold nan" in err["message"], err
            r = client.post("/v1/completions", json={**body, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want

# ---- shutdown ----
def test_cache_events_end_at_shutdown_whatever_their_interval(ckpt):
    # `expertcache serve` stops the scheduler first at Ctrl-C, then waits for connections to
    # close (5 s at most, then cuts them). An event stream asked for at `interval=10` slept its
    # whole interval before it looked: shutdown waited for it, and then cut it.
    srv = LiveServer(create_app(expertcache.load(ckpt, ctx_size=CTX)))
    began, ended, lines = threading.Event(), threading.Event(), []

    def events():
        with httpx.stream("GET", srv.url + "/cache/events", params={"interval": 10}, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    began.set()
        ended.set()

    t = threading.Thread(target=events, daemon=True)
    try:
        t.start()
        assert began.wait(TIMEOUT), "the event stream did not begin"
        srv.app.state.scheduler.stop()  # what the CLI's shutdown does first
        assert ended.wait(3.0), "the event stream did not end when the server began shutting down"
    finally:
        srv.stop()
        t.join(TIMEOUT)


# ---- the queue ----
def test_a_queued_client_that_left_is_not_counted_as_waiting(ckpt):
    # A request waits behind a running one and its client gives up. It is dropped unrun when the
    # worker gets to it, but until then `requests_deferred` (and /cache/state's `deferred`, the
    # page's "requests queued") still counted it as waiting.
    model = expertcache.load(ckpt, ctx_size=CTX)
    first, release = hold_after_first_piece(model)
    srv = LiveServer(create_app(model))
    sched = srv.app.state.scheduler
    jobs: list[Job] = []
    submitted = _submits(sched, jobs)
    out = {}

    def running():
        body = {"prompt": "w1 w2", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        out["running"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)

    t = threading.Thread(target=running, daemon=True)
    try:
        t.start()
        assert submitted.acquire(timeout=TIMEOUT) and first.wait(TIMEOUT), "the first request did not start"
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            # A queued request whose client leaves once the server has queued it.
            body = json.dumps({"prompt": "w7 w8", "max_tokens": 2}).encode()
            with socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert submitted.acquire(timeout=TIMEOUT), "the second request was not queued"
                assert sched.snapshot().deferred == 1
            # Its client is gone: the server notices within DISCONNECT_POLL_S and cancels the job.
            assert jobs[1].cancelled.wait(5.0), "the server did not notice the client leave"
            assert sched.snapshot().deferred == 0, "a client that left still counts as waiting"
            metrics = c.get("/metrics").text
            assert "expertcache_requests_deferred 0.0" in metrics
            assert c.get("/cache/state").json()["server"]["deferred"] == 0
    finally:
        release.set()
        t.join(TIMEOUT)
        srv.stop()
    assert out["running"].status_code == 200
    s = sched.snapshot()
    assert (s.requests, s.aborted, s.deferred) == (2, 1, 0), s


def _submits(sched: Scheduler, jobs: list | None = None) -> threading.Semaphore:
    """A semaphore released once per job submitted to `sched` (wraps its submit); each job is
    appended to `jobs` where given."""
    submitted, real = threading.Semaphore(0), sched.submit

    def submit(job):
        real(job)
        if jobs is not None:
            jobs.append(job)
        submitted.release()

    sched.submit = submit
    return submitted


def test_a_restart_after_a_stop_that_gave_up_waits_for_the_old_worker(ckpt):
    # A job deaf to cancellation outlives stop()'s wait. Starting the app again then started a
    # second worker beside the first: two threads running one model. The restarted worker must
    # serve once the old one is gone (a second stop() leaves one sentinel, for the old one).
    model = expertcache.load(ckpt, ctx_size=CTX)
    real, lock = model.generate, threading.Lock()
    entered, release = threading.Event(), threading.Event()
    running, most = [0], [0]

    def generate(ids, **kw):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        entered.set()
        release.wait(TIMEOUT)
        with lock:
            running[0] -= 1
        return real(ids, **kw)

    model.generate = generate

    def workers() -> set:
        return {t for t in threading.enumerate() if t.name == "expertcache-worker" and t.is_alive()}

    before = workers()
    sched = Scheduler(model, n_slots=1)
    sched.start()
    results = []
    done = [threading.Event(), threading.Event()]
    ids = model.tokenizer.encode("w1 w2")
    for i in range(2):
        job = Job(ids, {"max_tokens": 2, "temperature": 0},
                  on_done=lambda res, err, i=i: (results.append((i, res, err)), done[i].set()))
        if i == 0:
            sched.submit(job)
            assert entered.wait(TIMEOUT), "the first job did not start"
            sched.stop(timeout=0.05)
            sched.stop(timeout=0.05)
            restart = threading.Thread(target=sched.start, daemon=True)
            restart.start()
            restart.join(0.5)  # the restart has had time to start a worker, if it does not wait
            assert len(workers() - before) == 1, "a second worker started beside the one still running"
            release.set()
            restart.join(TIMEOUT)
            assert not restart.is_alive() and done[0].wait(TIMEOUT)
        else:
            sched.submit(job)
            assert done[1].wait(TIMEOUT), "the restarted worker did not serve"
    sched.stop()
    assert most[0] == 1
    assert results[1][2] is None and results[1][1].token_ids, results[1]


def test_requests_beyond_the_slots_run_first_come_first_served(ckpt):
    # One request runs (held at its first piece) while four more arrive one after another, two of
    # them continuing the held one's prompt on a server of two slots: they run in the order they
    # came, each reused prefix is the right one, and every answer is the one a fresh model gives.
    model = expertcache.load(ckpt, ctx_size=CTX)
    ref = expertcache.load(ckpt, ctx_size=CTX)
    order = []
    real = model.generate

    def recording(ids, **kw):
        order.append(list(ids))
        return real(ids, **kw)

    model.generate = recording
    first, release = hold_after_first_piece(model)
    prompts = ["w10 w11 w12 w13", "w10 w11 w12 w13 w14 w15", "w60 w61", "w10 w11 w12 w13 w14 w15 w16", "w70"]
    out: dict[int, httpx.Response] = {}
    with TestClient(create_app(model, n_slots=2)) as client:
        submitted = _submits(client.app.state.scheduler)

        def ask(i):
            body = {"prompt": prompts[i], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            out[i] = client.post("/v1/completions", json=body)

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(prompts))]
        try:
            for i, t in enumerate(threads):
                t.start()
                assert submitted.acquire(timeout=TIMEOUT), f"request {i} was not queued"
                if i == 0:
                    assert first.wait(TIMEOUT), "the first request did not start"
            assert client.app.state.scheduler.snapshot().deferred == len(prompts) - 1
        finally:
            release.set()
            for t in threads:
                t.join(TIMEOUT)
    assert [model.tokenizer.decode(ids) for ids in order] == prompts
    for i, p in enumerate(prompts):
        r = out[i].json()
        assert r["choices"][0]["text"] == ref.generate(p, max_tokens=4, temperature=0, ignore_eos=True).text, i
    cached = [out[i].json()["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(len(prompts))]
    assert cached[0] == 0 and cached[1] >= 4 and cached[2] == 0 and cached[3] >= 6, cached


def test_metrics_and_cache_state_while_a_request_runs(ckpt):
    # /metrics and /cache/state are read on the event loop while the worker generates: every read
    # answers, counters never go down, and once the worker is idle both agree.
    from prometheus_client.parser import text_string_to_metric_families

    model = expertcache.load(ckpt, ctx_size=CTX, cache=CacheConfig(mode="cache", experts=5))
    first, release = hold_after_first_piece(model)
    done = threading.Event()
    with TestClient(create_app(model)) as client:
        def scrape() -> dict:
            r = client.get("/metrics")
            assert r.status_code == 200, r.text
            out = {}
            for fam in text_string_to_metric_families(r.text):
                for s in fam.samples:
                    out[(s.name, tuple(sorted(s.labels.items())))] = (fam.type, s.value)
            return out

        def run():
            body = {"prompt": "w5 w6 w7", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
            try:
                assert client.post("/v1/completions", json=body).status_code == 200
            finally:
                done.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            assert first.wait(TIMEOUT), "the request did not start"
            m = scrape()
            assert m[("expertcache_requests_processing", ())][1] == 1.0
            state = client.get("/cache/state").json()
            assert state["server"]["processing"] == 1 and state["server"]["deferred"] == 0
        finally:
            release.set()
        while True:  # read while the worker generates (as long as it does)
            finished = done.is_set()
            now = scrape()
            for key, (kind, value) in m.items():
                if kind == "counter" and key in now:
                    assert now[key][1] >= value, key
            assert client.get("/cache/state").status_code == 200
            m = now
            if finished:
                break
        t.join(TIMEOUT)
        m, state = scrape(), client.get("/cache/state").json()
    assert m[("expertcache_tokens_predicted_total", ())][1] == state["server"]["predicted_tokens"] == 60
    assert m[("expertcache_requests_processing", ())][1] == 0.0 and state["server"]["processing"] == 0
    hits = sum(v for (name, _), (_, v) in m.items() if name == "expertcache_cache_resident_hits_total")
    assert hits == state["total"]["resident_hits"]


def _rewrite_in_place(src, dst):
    data = src.read_bytes()
    with open(dst, "r+b") as f:
        f.write(data)


def test_weights_rewritten_mid_stream_end_it_with_an_error_and_the_next_request_runs(ckpt, tmp_path):
    # The checkpoint is rewritten in place after a stream's first piece: the stream ends with a
    # `model_changed` error event and [DONE], and the next request runs on the new weights.
    work = tmp_path / "model"
    shutil.copytree(ckpt, work)
    new = save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=1), tmp_path / "new")
    assert (new / "model.safetensors").stat().st_size == (work / "model.safetensors").stat().st_size
    model = expertcache.load(work, ctx_size=CTX, cache=CacheConfig(mode="cache", experts=3, store="disk"))
    first, release = hold_after_first_piece(model)
    store = model.experts.store
    body = {"prompt": "w3 w4 w5 w6", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    out = {}
    with TestClient(create_app(model, n_slots=1)) as client, \
            TestClient(create_app(expertcache.load(new, ctx_size=CTX), n_slots=1)) as fresh:
        def run():
            out["stream"] = client.post("/v1/completions", json=body)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            assert first.wait(TIMEOUT), "the stream did not start"
            store.read_hook = lambda n: _rewrite_in_place(new / "model.safetensors", work / "model.safetensors")
        finally:
            release.set()
            t.join(TIMEOUT)
        store.read_hook = None
        r = out["stream"]
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "model_changed", events[-3:]
        assert len(events) - 2 < 40  # cut short
        plain = {**body, "stream": False}
        got = client.post("/v1/completions", json=plain).json()
        want = fresh.post("/v1/completions", json=plain).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["timings"]["cache_n"] == 0
