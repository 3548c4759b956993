"""What an OpenAI client gets for the parameters it may send: a parameter the server does not
honour is refused with 400 `unsupported_parameter` naming it (before any byte of a stream), never
ignored in a way that changes the answer; its neutral value, and the fields that only label a
request, leave the answer exactly as it is without them."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import expertcache
from conftest import assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config
from expertcache.server.app import create_app

CTX = 128
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path_factory.mktemp("compat") / "m")
    with TestClient(create_app(expertcache.load(ckpt, ctx_size=CTX))) as c:
        yield c


def base(path: str) -> dict:
    prompt = {"messages": [{"role": "user", "content": "w5 w9"}]} if path == CHAT else {"prompt": "w5 w9 w17"}
    return {**prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def answer(r) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def refused(client, path: str, fields: dict, param: str, code: str | None = "unsupported_parameter") -> str:
    """Assert the request is a 400 naming `param`, streamed or not; return the message."""
    for stream in (False, True):
        r = client.post(path, json={**base(path), **fields, "stream": stream})
        assert r.status_code == 400, (fields, stream, r.text[:300])
        assert r.headers["content-type"].startswith("application/json")  # before any byte of a stream
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error", err
        assert param in err["message"], err
    return err["message"]


# Each would change the answer if it were ignored: refused on both routes.
NOT_HONOURED = [
    ({"presence_penalty": 1.5}, "presence_penalty"),
    ({"frequency_penalty": -0.5}, "frequency_penalty"),
    ({"logit_bias": {"5": -100}}, "logit_bias"),
    ({"repeat_penalty": 1.3}, "repeat_penalty"),           # llama-server's sampler
    ({"grammar": 'root ::= "w1"'}, "grammar"),
    ({"max_token": 2}, "max_token"),                        # a misspelt max_tokens
]


@pytest.mark.parametrize("path", [CHAT, CMPL])
@pytest.mark.parametrize("fields,param", NOT_HONOURED)
def test_a_parameter_not_honoured_is_refused_by_name(client, path, fields, param):
    refused(client, path, fields, param)


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"prompt": "w1"}, "prompt"),  # the legacy route's field: the chat route would answer the messages only
])
def test_chat_refuses_what_it_cannot_do(client, fields, param):
    refused(client, CHAT, fields, param)


def test_completions_refuse_logprobs_0_and_messages(client):
    # The chat route's template variables: the legacy route has no template.
    refused(client, CMPL, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs")
    # The legacy `logprobs: 0` still asks for the chosen tokens' log probabilities.
    assert "only null" in refused(client, CMPL, {"logprobs": 0}, "logprobs")
    # The chat route's field: the legacy route would answer the prompt only.
    refused(client, CMPL, {"messages": [{"role": "user", "content": "w1"}]}, "messages")


@pytest.mark.parametrize("fields,param", [({"logit_bias": "w1"}, "logit_bias"), ({"tools": {}}, "tools"),
                                          ({"tool_choice": 3}, "tool_choice")])
def test_a_wrong_type_is_a_plain_400(client, fields, param):
    refused(client, CHAT, fields, param, code=None)


@pytest.mark.parametrize("path,fields", [
    (CHAT, {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "parallel_tool_calls": False, "functions": [], "function_call": "auto", "modalities": ["text"],
            "logprobs": False, "top_logprobs": 0, "n": 1, "response_format": {"type": "text"}}),
    (CMPL, {"presence_penalty": 0, "logit_bias": {}, "n": 1, "echo": False, "best_of": 1, "suffix": "", "tools": [],
            "tool_choice": "auto", "top_logprobs": 0}),
    # Labels of the request, accepted and ignored: they change nothing in the answer.
    (CHAT, {"user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
            "prompt_cache_key": "p", "safety_identifier": "s"}),
    (CMPL, {"user": "u-1"}),
])
def test_neutral_values_and_labels_leave_the_answer_as_it_is(client, path, fields):
    want = answer(client.post(path, json=base(path)))
    assert answer(client.post(path, json={**base(path), **fields})) == want
    # And the refusals above left the server serving the same answers.
    assert answer(client.post(path, content=json.dumps(base(path)).encode(),
                              headers={"content-type": "application/json"})) == want


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """llama-server's and vLLM's `chat_template_kwargs`: more variables for the template (Qwen3's
    `enable_thinking`); the prompt is what encode_chat renders with them."""
    ckpt = save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path / "m")
    (ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }} {% endfor %}{% if flavour is defined %}{{ flavour }}{% endif %}")
    model = expertcache.load(ckpt, ctx_size=CTX)
    messages = [{"role": "user", "content": "w5 w9"}]
    with TestClient(create_app(model)) as c:
        plain = c.post(CHAT, json=base(CHAT)).json()
        r = c.post(CHAT, json={**base(CHAT), "chat_template_kwargs": {"flavour": "w3 w4 w8"}})
        assert r.status_code == 200, r.text
        ids = model.tokenizer.encode_chat(messages, flavour="w3 w4 w8")
        assert r.json()["usage"]["prompt_tokens"] == len(ids) == plain["usage"]["prompt_tokens"] + 3
        want = model.generate(ids, max_tokens=6, temperature=0, ignore_eos=True).text
        assert answer(r) == want
        for value, what in (("x", "must be an object"), ({"messages": []}, "may not set 'messages'"),
                            ({"add_generation_prompt": False}, "may not set"), ({"a-b": 1}, "not a template variable")):
            err = c.post(CHAT, json={**base(CHAT), "chat_template_kwargs": value})
            assert err.status_code == 400 and err.json()["error"]["param"] == "chat_template_kwargs", err.text
            assert what in err.json()["error"]["message"]


PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_a_page_of_another_origin_may_call_the_api(tmp_path):
    """As llama-server and vLLM answer by default: a browser's preflight (no key) is allowed, and
    the answers, a refusal included, carry the header that lets the page read them."""
    ckpt = save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path / "m")
    model = expertcache.load(ckpt, ctx_size=CTX)
    with TestClient(create_app(model, api_key="k1")) as c:
        r = c.options(CHAT, headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert {"authorization", "content-type"} <= set(r.headers["access-control-allow-headers"].lower().split(", "))
        origin = {"Origin": "http://localhost:3000"}
        ok = c.post(CHAT, json=base(CHAT), headers={**origin, "Authorization": "Bearer k1"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
        denied = c.post(CHAT, json=base(CHAT), headers=origin)
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    # Only the origins named; none at all.
    with TestClient(create_app(model, cors_origins=("http://localhost:3000",))) as c:
        assert c.options(CHAT, headers=PREFLIGHT).headers["access-control-allow-origin"] == "http://localhost:3000"
        other = c.options(CHAT, headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with TestClient(create_app(model, cors_origins=())) as c:
        r = c.post(CHAT, json=base(CHAT), headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_serve_refuses_an_origin_that_is_not_one(capsys):
    assert_one_line_error(*run_cli(capsys, "serve", "--cors-origins", "localhost:3000"), "--cors-origins",
                          "'localhost:3000' is not an origin")
    assert_one_line_error(*run_cli(capsys, "serve", "--cors-origins", "http://a.example/chat"), "not an origin")


def test_text_parts_are_joined_by_newlines_as_vllm_and_llama_server_join_them(client):
    def chat(content):
        return answer(client.post(CHAT, json={**base(CHAT), "messages": [{"role": "user", "content": content}]}))

    parts = [{"type": "text", "text": "w5 w9"}, {"type": "text", "text": "w17"}]
    assert chat(parts) == chat("w5 w9\nw17")
    # The rendered prompts differ with the separator, so the answer says which one was used.
    assert chat("w5 w9\nw17") != chat("w5 w9w17")
    refused(client, CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content", code=None)
