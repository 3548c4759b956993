"""A client's mistake is a 4xx naming the parameter, before any byte of a stream; the stream adds
up to the non-streamed text (stop strings spanning tokens included); the API key; the body limit;
the event loop stays free while a large prompt is tokenized; and the CLI's one-line errors."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from fastapi.testclient import TestClient

import expertcache
from conftest import LiveServer, assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config
from expertcache.errors import ExpertCacheError
from expertcache.sampling import Sampler, SamplingParams
from expertcache.server.app import create_app
from expertcache.server.auth import read_api_key
from expertcache.engine import held_back
from expertcache.tokenizer import Tokenizer

CTX = 256
KEY = "k3y-for-tests"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path_factory.mktemp("lim") / "m")


@pytest.fixture(scope="module")
def ref(ckpt):
    return expertcache.load(ckpt, ctx_size=CTX)


@pytest.fixture(scope="module")
def client(ckpt):
    with TestClient(create_app(expertcache.load(ckpt, ctx_size=CTX), max_body_bytes=64 * 1024)) as c:
        yield c


def sse_events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_text(events: list, chat: bool) -> str:
    pieces = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            pieces.append(c["delta"].get("content") or "" if chat else c["text"])
    return "".join(pieces)


# ---- sampling and the tokenizer ----
@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-30])
def test_tiny_temperature_samples_the_argmax(temperature):
    # The limit of softmax(logits / T) as T -> 0 is the argmax: greedy is the reference.
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(500, generator=g) * 30
        assert Sampler(SamplingParams(temperature, seed=1))(logits) == int(torch.argmax(logits))


def test_sampling_at_a_normal_temperature_is_unchanged():
    # softmax is shift-invariant: the shifted logits sample exactly what torch does unshifted.
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 4
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        want = int(torch.multinomial(torch.softmax(logits / 0.7, -1), 1, generator=g))
        assert Sampler(SamplingParams(0.7, seed=seed))(logits) == want


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": float("nan")}, "temperature nan"), ({"temperature": float("inf")}, "temperature inf"),
    ({"seed": 2**64}, "seed 18446744073709551616"), ({"seed": -(2**63) - 1}, "64 bits"),
])
def test_sampling_params_refuse(kwargs, needle):
    with pytest.raises(ExpertCacheError, match=needle):
        SamplingParams(**kwargs)


def test_tokenizer_names_a_lone_surrogate_and_matches_tokenizers(ckpt):
    tok = Tokenizer(ckpt)
    text = "w1 w2  w3\nw17 w5"
    assert tok.encode(text) == tok.tok.encode(text).ids  # the GIL-free path encodes the same
    long_ids = list(range(4, 120)) * 50
    assert tok.decode(long_ids) == tok.tok.decode(long_ids)
    with pytest.raises(ExpertCacheError, match="lone surrogate U\\+D800 at character 3"):
        tok.encode("w1 \ud800 w2")


def test_a_template_that_fails_to_render_is_an_error(ckpt, tmp_path):
    tok = Tokenizer(ckpt)
    tok.chat_template, tok._compiled = "{{ messages[0]['content'] + 1 }}", None
    with pytest.raises(ExpertCacheError, match="failed to render"):
        tok.render_chat([{"role": "user", "content": "w1"}])


# ---- stop strings in a stream ----
def test_held_back_is_the_longest_possible_stop_start():
    assert held_back("abc\ncla", ["\nclass _"]) == 4
    assert held_back("abc", ["\nclass _"]) == 0
    assert held_back("ab", ["b", "bcd"]) == 1  # a one-character stop never waits: the engine cuts it


def _stop_spanning_tokens(ref, prompt: str, **gen) -> str:
    """A stop string made of the end of one generated piece and the start of the next."""
    pieces = []
    ref.generate(prompt, max_tokens=12, ignore_eos=True, on_text=pieces.append, **gen)
    assert len(pieces) >= 6
    before = "".join(pieces[:3])
    return before[-2:] + pieces[3][:3]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("gen", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_stream_equals_non_stream_with_stop_strings(client, ref, chat, gen):
    prompt = "w5 w9 w17"
    stop = _stop_spanning_tokens(ref, prompt, **gen) if not chat else None
    if chat:
        pieces = []
        ref.chat([{"role": "user", "content": prompt}], max_tokens=12, ignore_eos=True, on_text=pieces.append, **gen)
        stop = "".join(pieces[:3])[-2:] + pieces[3][:3]
    stops = [stop, "w9 nothing", "zz"]  # the others begin like generated text and never complete
    body = {"max_tokens": 12, "ignore_eos": True, "stop": stops, **gen}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    whole = client.post(path, json=body).json()
    text = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert whole["choices"][0]["finish_reason"] == "stop" and stop not in text
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert streamed_text(events, chat) == text
    for e in events[:-1]:  # no piece of the stop string ever leaked
        if e.get("choices"):
            piece = e["choices"][0]["delta"].get("content") if chat else e["choices"][0]["text"]
            assert not piece or stop not in text + piece[len(text):]


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_every_other_chunk_has_usage_null(client, chat):
    body = {"max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body.update({"messages": [{"role": "user", "content": "w3 w4"}]} if chat else {"prompt": "w3 w4"})
    events = sse_events(client.post(path, json=body).text)
    chunks = [e for e in events if isinstance(e, dict)]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    plain = sse_events(client.post(path, json={**body, "stream_options": None}).text)
    assert all("usage" not in c for c in plain if isinstance(c, dict))


# ---- /v1/models/{id} ----
def test_model_card_and_unknown_model(client, ckpt):
    card = client.get(f"/v1/models/{ckpt.name}").json()
    assert card == {"id": ckpt.name, "object": "model", "created": card["created"], "owned_by": "expertcache"}
    assert card == {k: v for k, v in client.get("/v1/models").json()["data"][0].items() if k != "meta"}
    for name in ("nope", "org/nope"):
        r = client.get(f"/v1/models/{name}")
        assert r.status_code == 404
        assert r.json()["error"] == {"message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                                     "param": "model", "code": "model_not_found"}


# ---- a client's mistakes ----
BAD_COMPLETIONS = [
    ({"temperature": 10**400}, "temperature"),
    ({"temperature": "1e-300"}, "temperature"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": int("9" * 100)}, "seed"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": int("1" * 100)}, "top_k"),
    ({"prompt": [5, 2**70]}, "prompt"),
    ({"prompt": "w1 \ud800 w2"}, "prompt"),
    ({"stop": ["\udfff"]}, "stop"),
    ({"stop": ["w1"] * 17}, "stop"),
    ({"stop": "w" * 1025}, "stop"),
    ({"n": 10**50}, "n"),
    ({"logprobs": {"a": 1}}, "logprobs"),
    ({"stream_options": [1]}, "stream_options"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    ({"n": True}, "n"),  # True == 1 in Python: a boolean is not the supported value
    ({"echo": 0}, "echo"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),  # accepted and ignored, but typed
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"prompt": "w1 " * 1000}, "prompt"),  # beyond the context
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields,param", BAD_COMPLETIONS)
def test_bad_values_are_400_naming_the_field_before_any_byte(client, fields, param, stream):
    body = {"prompt": "w1 w2", "max_tokens": 2, "stream": stream, **fields}
    raw = json.dumps(body, ensure_ascii=True).encode()  # JSON escapes keep lone surrogates as \udxxx
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert r.headers["content-type"].startswith("application/json")


def test_tiny_temperature_is_greedy_over_http(client, ref):
    want = ref.generate("w5 w9 w17", max_tokens=6, temperature=0, ignore_eos=True).text
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": "w5 w9 w17", "max_tokens": 6, "temperature": 1e-300,
                                                  "seed": 3, "ignore_eos": True, "stream": stream})
        assert r.status_code == 200
        got = streamed_text(sse_events(r.text), False) if stream else r.json()["choices"][0]["text"]
        assert got == want


@pytest.mark.parametrize("raw,code", [
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    (b'{"prompt": "w1", "x": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}", "invalid_json"),
    (b'{"prompt": "w1", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    (b'{"prompt": "w1 \xff\xfe"}', "invalid_json"),
    (b'{"prompt": "w1", "\\ud800": 1}', None),
])
def test_malformed_bodies_are_400(client, raw, code):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (400, 413), r.text
    if r.status_code == 400:
        assert r.json()["error"]["code"] == code


def test_a_template_that_fails_over_http_is_400_before_any_byte(ckpt, tmp_path):
    model = expertcache.load(ckpt, ctx_size=CTX)
    model.tokenizer.chat_template = "{% for m in messages %}{{ m.tool_calls[0].name }}{% endfor %}"
    with TestClient(create_app(model)) as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}],
                                                      "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "failed to render" in r.json()["error"]["message"]


def test_body_limit_is_413(client):
    big = {"prompt": "w1 " * 30_000, "max_tokens": 1}  # about 90 KB, over the 64 KiB limit
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b" " * 1024

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 1}).status_code == 200


def test_a_client_that_leaves_mid_body_is_not_a_server_error(client):
    # The body stops half-way and the client is gone: starlette's ClientDisconnect must be answered
    # as the client's mistake, not escape as an error that uvicorn logs with a traceback.
    import asyncio

    incoming = [{"type": "http.request", "body": b'{"prompt": "w1 w', "more_body": True}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(client.app(scope, receive, send))  # raised ClientDisconnect before the fix
    assert 400 <= sent[0]["status"] < 500
    assert client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 1}).status_code == 200


def test_unknown_route_and_method_are_named(client):
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"  # a 405 must say what the route takes
    err = r.json()["error"]
    assert err["code"] == "method_not_allowed" and "GET /v1/chat/completions" in err["message"], err
    assert "POST" in err["message"]
    r = client.post("/v1/embeddings", json={"input": "w1"})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "not_found" and "POST /v1/embeddings" in err["message"], err


# ---- the API key ----
def test_api_key(ckpt):
    with TestClient(create_app(expertcache.load(ckpt, ctx_size=CTX), api_key=KEY)) as c:
        body = {"prompt": "w1 w2", "max_tokens": 1}
        for method, path, kw in [("post", "/v1/completions", {"json": body}), ("get", "/v1/models", {}),
                                 ("get", "/v1/models/m", {}), ("get", "/metrics", {}), ("get", "/props", {}),
                                 ("post", "/tokenize", {"json": {"content": "w1"}}),
                                 ("post", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "w1"}]}})]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer"}):
                r = getattr(c, method)(path, headers=headers, **kw)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"]
            r = getattr(c, method)(path, headers={"Authorization": f"Bearer {KEY}"}, **kw)
            assert r.status_code == 200, (path, r.text)
        assert c.get("/health").status_code == 200


def test_read_api_key(tmp_path):
    f = tmp_path / "key"
    f.write_text(f"{KEY}\nignored\n")
    assert read_api_key(None, str(f)) == KEY
    assert read_api_key("abc", None) == "abc" and read_api_key(None, None) is None
    for key, path, needle in [("a", str(f), "not both"), (None, str(tmp_path / "none"), "cannot read"),
                              ("a b", None, "printable ASCII"), ("", None, "non-empty")]:
        with pytest.raises(ExpertCacheError, match=needle):
            read_api_key(key, path)


def test_listening_beyond_loopback_without_a_key_warns():
    from expertcache.commands.args import open_listener_warning

    assert "without an API key" in open_listener_warning("0.0.0.0", False)
    assert "without an API key" in open_listener_warning("::", False)
    assert open_listener_warning("0.0.0.0", True) is None
    assert open_listener_warning("127.0.0.1", False) is None and open_listener_warning("::1", False) is None


# ---- the event loop stays free ----
def test_health_answers_while_a_large_prompt_is_tokenized(ckpt):
    srv = LiveServer(create_app(expertcache.load(ckpt, ctx_size=CTX)))
    try:
        done = threading.Event()
        result = {}

        def big():
            prompt = "w1 w22 w3 w45 " * 400_000  # ~5.6 MB: seconds of tokenizing
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)
            result["status"] = r.status_code
            result["error"] = r.json()["error"]
            done.set()

        t = threading.Thread(target=big)
        t.start()
        time.sleep(1.0)  # the body is in; tokenizing has begun
        t0 = time.monotonic()
        health = httpx.get(srv.url + "/health", timeout=60)
        waited = time.monotonic() - t0
        busy = not done.is_set()
        t.join(120)
        assert health.status_code == 200
        assert busy, "the large prompt finished before /health was asked: the test proves nothing"
        assert waited < 1.0, f"/health took {waited:.2f}s while a prompt was tokenized"
        assert result["status"] == 400 and result["error"]["code"] == "context_length_exceeded"
    finally:
        srv.stop()


# ---- prefill cancellation ----
class _FakeModel:
    """Just enough of a Model for the scheduler: records what generate() was given."""

    def __init__(self):
        self.kwargs = None

    def new_session(self):
        from types import SimpleNamespace

        return SimpleNamespace(tokens=[], truncate=lambda n: None)

    def generate(self, ids, session=None, on_text=None, should_stop=None, **gen):
        self.kwargs = {"should_stop": should_stop, **gen}
        from expertcache.engine import GenerationResult

        return GenerationResult("", [], len(ids), 0, "abort" if should_stop() else "length", 0.0, 0.0)


def test_scheduler_passes_the_cancellation_check_to_the_prefill():
    from expertcache.server.slots import Job, Scheduler

    model = _FakeModel()
    sched = Scheduler(model)
    job = Job([1, 2], {"max_tokens": 1})
    done = []
    job.on_done = lambda res, err: done.append((res, err))
    sched._serve(job)
    assert model.kwargs["should_stop"]() is False
    job.cancelled.set()
    assert model.kwargs["should_stop"]() is True


def test_a_prefill_stops_when_its_client_leaves(ckpt):
    model = expertcache.load(ckpt, ctx_size=CTX)

    left = threading.Event()

    class Held:
        """A layer's mixer that runs only once the client has gone (or after 30 s), so that the
        prompt is still being prefilled when it leaves, however fast the host is."""

        def __init__(self, mixer):
            self.mixer = mixer

        def __getattr__(self, name):
            return getattr(self.mixer, name)

        def __call__(self, *args):
            left.wait(30)
            return self.mixer(*args)

    for lw in model.net.weights.layers:
        lw.mixer = Held(lw.mixer)
    srv = LiveServer(create_app(model, ubatch=1))  # attention one token at a time
    try:
        before = model.telemetry()["total"]["ops_seen"]
        prompt = [5 + (i % 100) for i in range(CTX - 8)]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=0.5)
        left.set()
        sched = srv.server.config.app.state.scheduler
        deadline = time.monotonic() + 60
        while sched.snapshot().processing or sched.snapshot().deferred:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ops = model.telemetry()["total"]["ops_seen"] - before
        # The prompt is one stretch: one MoE op per layer once every layer's attention has run
        # token by token; the client left during the first layer's attention.
        full = len(model.cfg.moe_layers)
        assert ops < full, f"{ops} MoE ops of {full}: the prefill ran on after its client left"
    finally:
        left.set()
        srv.stop()


# ---- the CLI ----
@pytest.mark.parametrize("argv,needle", [
    (["--temp", "nan"], "not a finite number"),
    (["--temp", "inf"], "not a finite number"),
    (["--top-p", "nan"], "not a finite number"),
    (["--seed", str(2**64)], "beyond 64 bits"),
    (["--seed", str(-(2**63) - 1)], "beyond 64 bits"),
    (["--device", "foo"], "'foo' is not a device"),
    (["--device", "cuda:99"], "cuda:99"),
    (["--device", "meta"], "not supported"),
])
def test_cli_bad_values_are_one_line(capsys, ckpt, argv, needle):
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1", *argv), needle)


def test_cli_device_unavailable(capsys, ckpt):
    if torch.cuda.is_available():
        argv, needle = ["--device", f"cuda:{torch.cuda.device_count()}"], "does not exist"
    else:
        argv, needle = ["--device", "cuda"], "not available"
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1", *argv), needle)


def test_cli_run_without_tokenizer(capsys, ckpt, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpt, d)
    (d / "tokenizer.json").unlink()
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(d), "-p", "w1"), "tokenizer.json")


def test_cli_chat_template_that_fails(capsys, ckpt, tmp_path, monkeypatch):
    import io
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpt, d)
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] + 1 }}")
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2\n"))
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(d), "--chat"), "failed to render")


def test_cli_tiny_temperature_is_greedy(capsys, ckpt, ref):
    from expertcache.cli import main

    want = ref.generate("w5 w9", max_tokens=4, temperature=0, ignore_eos=True).text
    capsys.readouterr()
    assert main(["run", "-m", str(ckpt), "-p", "w5 w9", "-n", "4", "--temp", "1e-300", "--seed", "1",
                 "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == want
