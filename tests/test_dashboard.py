"""/cache/state and /cache/events without a browser (tests/test_web.py drives the page): on the
bundled model with a quarter of the experts in the cache, the snapshot agrees with the cache's
own bookkeeping and counters, counts the tokens the engine ran, streams as server-sent events,
and wants the API key when the server has one."""

from __future__ import annotations

import json

import pytest

import expertcache
from expertcache import CacheConfig
from expertcache.server.app import create_app
from fastapi.testclient import TestClient

KEY = "dashboard-key"


@pytest.fixture(scope="module")
def model():
    return expertcache.load(None, ctx_size=512, cache=CacheConfig(mode="cache", fraction=0.25))


def resident_of(cache) -> dict[str, list[int]]:
    """Resident experts from the slot map (the snapshot reads the per-layer masks instead)."""
    out = {str(layer): [] for layer in cache.moe_layers}
    for key in cache.residency.resident_keys():
        out[str(key.layer)].append(key.expert)
    return {layer: sorted(ids) for layer, ids in out.items()}


def test_state_agrees_with_the_cache_and_counts_tokens(model):
    with TestClient(create_app(model)) as c:
        s0 = c.get("/cache/state").json()
        r = c.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 12, "ignore_eos": True,
                                            "temperature": 0}).json()
        s = c.get("/cache/state").json()
    t = model.telemetry()
    assert {k: s[k] for k in ("mode", "policy", "store", "capacity", "total_experts", "expert_bytes", "pool_bytes")} \
        == {k: t[k] for k in ("mode", "policy", "store", "capacity", "total_experts", "expert_bytes", "pool_bytes")}
    assert s["mode"] == "cache" and s["capacity"] == s["total_experts"] // 4
    assert s["total"] == t["total"] and s["layers"] == t["layers"] and s["invalidations"] == t["invalidations"]
    assert s["moe_layers"] == list(model.cfg.moe_layers) and s["num_experts"] == model.cfg.num_experts
    assert s["resident"] == resident_of(model.experts)
    assert sum(map(len, s["resident"].values())) == s["capacity"]  # the pool has filled
    assert s["prefetching"] == {layer: [] for layer in s["resident"]}
    # Every prompt token runs once; each generated token but the last runs once more.
    timings = r["timings"]
    assert s["tokens"] - s0["tokens"] == timings["prompt_n"] + timings["predicted_n"] - 1
    assert s["server"]["requests"] == s0["server"]["requests"] + 1 and s["server"]["slots"] == 1
    assert s["server"]["predicted_tokens"] - s0["server"]["predicted_tokens"] == timings["predicted_n"]
    assert s["model"] == model.path.name
    json.dumps(s)


def test_events_stream_the_state_and_want_the_key(model):
    with TestClient(create_app(model, api_key=KEY)) as c:
        assert c.get("/").status_code == 200 and "<title>expertcache</title>" in c.get("/").text
        assert c.get("/static/main.js").status_code == 200
        for path in ("/cache/state", "/cache/events"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {KEY}"}
        bad = c.get("/cache/events?interval=0", headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval"
        state = c.get("/cache/state", headers=auth).json()
        with c.stream("GET", "/cache/events?interval=0.05", headers=auth) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            line = next(iter(r.iter_lines()))
        assert line.startswith("data: ")
        event = json.loads(line[len("data: "):])
        event.pop("time"), state.pop("time")
        assert event == state  # nothing ran in between


def test_the_page_works_behind_a_proxy_at_a_sub_path(model):
    """A reverse proxy serving the app at /llm/ (the prefix stripped, as a Starlette Mount does):
    every file the page loads and every route its scripts call must resolve under /llm/, so the
    page may name none by an absolute path."""
    import re
    from urllib.parse import urljoin

    from starlette.applications import Starlette
    from starlette.routing import Mount

    outer = Starlette(routes=[Mount("/llm", app=create_app(model))])
    with TestClient(outer) as c:
        page = "/llm/"
        html = c.get(page)
        assert html.status_code == 200 and "<title>expertcache</title>" in html.text
        files = re.findall(r'(?:src|href)="([^"]+)"', html.text)
        assert "static/main.js" in files
        pending, scripts = [urljoin(page, f) for f in files], {}  # url -> text: main.js and what it imports
        while pending:
            url = pending.pop()
            r = c.get(url)
            assert r.status_code == 200, url
            if url.endswith(".js") and url not in scripts:
                scripts[url] = r.text
                pending += [urljoin(url, imp) for imp in re.findall(r'from "(\./[^"]+)"', r.text)]
        calls = {m for text in scripts.values() for m in re.findall(r'api\("([^"]+)"', text)}
        assert {"v1/models", "v1/chat/completions", "cache/events"} <= calls, calls
        for call in calls:
            assert urljoin(page, call).startswith(page), call  # a fetch resolves against the page
        assert c.get(urljoin(page, "v1/models")).json()["data"][0]["id"] == model.path.name
