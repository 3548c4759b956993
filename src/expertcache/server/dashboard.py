"""The server's web page and the live view of the expert cache behind it.

`add_dashboard(app, model, scheduler)` adds:
- `GET /`: the page (static files shipped in `server/static/`, no build step, nothing fetched from
  elsewhere), and `GET /static/...` for its scripts and style. The page itself is open; it asks for
  the API key when a data call answers 401 and sends it as a bearer token.
- `GET /cache/state`: one JSON snapshot of the cache (`snapshot()` below; docs/server.md has the format).
- `GET /cache/events`: server-sent events, one `data: <snapshot>` whenever the snapshot changed,
  checked `interval` seconds apart (default 0.25), and a `: ping` comment line every few seconds
  when nothing changed, so a client can tell a quiet server from a lost one.
Both data routes want the API key when the server has one (`auth.require_api_key`).

The snapshot is read on the event loop while the worker thread runs the model: it consists of
Python ints, strings and dicts copied at once, so it is never torn inside one value, but during a
request its counters and its resident sets may be a few ops apart. When the worker is idle the
snapshot is exact. Nothing here changes what the model computes.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from . import protocol as P
from .auth import require_api_key
from .slots import Scheduler

STATIC = Path(__file__).parent / "static"
PING_S = 2.0  # a quiet stream still sends a comment line this often
STOP_CHECK_S = 0.25  # how often an event stream between two looks checks for a shutdown


class TokenCounter:
    """Tokens through the model since start, counted where the first MoE layer is routed (a
    `routing_hook` on the model, chaining any hook already there). The cache counts ops, not
    tokens; this lets a client turn the cache's counters into per-token figures."""

    def __init__(self, model, previous=None):
        self.tokens = 0
        self.previous = previous
        moe = list(getattr(model.cfg, "moe_layers", []) or [])
        self.first = moe[0] if moe else None

    def __call__(self, layer: int, routing) -> None:
        if layer == self.first or self.first is None:
            self.first = layer
            self.tokens += int(routing.ids.shape[0])  # [T, A]: a shape, no device sync
        if self.previous is not None:
            self.previous(layer, routing)


def _mask_ids(mask: int) -> list[int]:
    out, e = [], 0
    while mask:
        if mask & 1:
            out.append(e)
        mask >>= 1
        e += 1
    return out


def snapshot(model, scheduler: Scheduler, counter: TokenCounter | None = None, model_id: str = "") -> dict:
    """The cache's state now, as plain JSON-ready values (see the module docstring on consistency)."""
    cache = model.experts
    telemetry = model.telemetry()  # safe while the worker runs ops (`Telemetry.total`)
    layers = [int(x) for x in getattr(cache, "moe_layers", getattr(model.cfg, "moe_layers", []))]
    residency = getattr(cache, "residency", None)
    # A cache that prefetches says which experts are in flight as a mask per layer, like
    # `resident_mask`; until one does, nothing is shown as prefetching.
    prefetching = getattr(cache, "prefetching_mask", None)
    stats = scheduler.snapshot()
    out = dict(telemetry)
    out.update(
        model=model_id,
        time=time.time(),
        moe_layers=layers,
        num_experts=int(getattr(cache, "num_experts", getattr(model.cfg, "num_experts", 0))),
        resident={str(layer): _mask_ids(residency.resident_mask(layer)) if residency is not None else []
                  for layer in layers},
        prefetching={str(layer): _mask_ids(prefetching(layer)) if prefetching is not None else []
                     for layer in layers},
        tokens=counter.tokens if counter is not None else 0,
        server={"slots": len(scheduler.slots), "requests": stats.requests, "aborted": stats.aborted,
                "failed": stats.errors, "prompt_tokens": stats.prompt_tokens,
                "cached_tokens": stats.cached_tokens, "predicted_tokens": stats.predicted_tokens,
                "processing": stats.processing, "deferred": stats.deferred, "refused": stats.refused},
    )
    return out


def _interval(request: Request) -> float:
    raw = request.query_params.get("interval", "0.25")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.05 <= value <= 10:  # also false for nan
        raise P.ApiError(f"'interval' must be a number of seconds in 0.05..10, got {raw!r}", param="interval")
    return value


def add_dashboard(app: FastAPI, model, scheduler: Scheduler, *, model_id: str = "") -> None:
    """Serve the page at `/` and the cache's state at `/cache/state` and `/cache/events` on `app`."""
    counter = model.net.routing_hook
    if not isinstance(counter, TokenCounter):  # another app over the same model already counts
        counter = model.net.routing_hook = TokenCounter(model, model.net.routing_hook)
    authorized = [Depends(require_api_key)]

    def state() -> dict:
        return snapshot(model, scheduler, counter, model_id)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/cache/state", dependencies=authorized)
    async def cache_state():
        return state()

    @app.get("/cache/events", dependencies=authorized)
    async def cache_events(request: Request):
        interval = _interval(request)

        async def events():
            last, quiet = None, 0.0
            while not scheduler.stopping.is_set():  # the server is shutting down: end the stream
                snap = state()
                same = {k: v for k, v in snap.items() if k != "time"}
                if same != last:
                    last, quiet = same, 0.0
                    yield f"data: {json.dumps(snap, separators=(',', ':'))}\n\n".encode()
                elif quiet >= PING_S:
                    quiet = 0.0
                    yield b": ping\n\n"
                # Slept in short steps: a stream asked for a long interval still ends as soon as
                # the server begins shutting down, not when its interval is over.
                waited = 0.0
                while waited < interval and not scheduler.stopping.is_set():
                    step = min(STOP_CHECK_S, interval - waited)
                    await asyncio.sleep(step)
                    waited += step
                quiet += interval

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
