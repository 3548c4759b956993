"""The OpenAI-compatible HTTP API over one loaded model: `create_app(model, ...)` returns a FastAPI
app. Requests are validated here (OpenAI's error shape, 400 for bad input) and queued to the
slot scheduler, whose single worker thread is the only code that runs the model."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import GenerationResult, Model
from ..errors import ExpertCacheError
from . import protocol as P
from .auth import require_api_key
from .dashboard import add_dashboard
from .metrics import make_registry
from .slots import Job, Scheduler

# While a non-streaming request waits, how often to check whether its client left.
DISCONNECT_POLL_S = 0.1


def create_app(model: Model, *, model_id: str | None = None, n_slots: int = 1, cache_prompt: bool = True,
               ubatch: int = 512, api_key: str | None = None) -> FastAPI:
    """An app serving `model` under `model_id` (default: the model directory's name) with
    `n_slots` slots of `model.ctx_size` tokens each; the worker runs while the app runs. With
    `api_key`, every /v1 route wants it as a bearer token (see auth.py)."""
    if model.tokenizer is None:
        raise ExpertCacheError(f"{model.path}: the server needs a tokenizer (tokenizer.json)")
    scheduler = Scheduler(model, n_slots, cache_prompt)
    served = model_id or model.path.name
    ctx = model.ctx_size

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="expertcache", lifespan=lifespan)
    app.state.scheduler, app.state.model_id, app.state.api_key = scheduler, served, api_key
    authorized = [Depends(require_api_key)]
    registry = make_registry(model, scheduler)

    # ---- errors: always OpenAI's shape ----
    @app.exception_handler(P.ApiError)
    async def api_error(request, e: P.ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return JSONResponse(P.error_body(f"invalid request: {e.errors()}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(P.error_body(str(e.detail), param=None, code=code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    async def body_of(request: Request) -> dict:
        body = P.parse_json(await request.body())
        P.check_model(body, served)
        return body

    def encode(fn, *args):
        try:
            return fn(*args)
        except ExpertCacheError as e:  # a chat template that refuses the messages, ...
            raise P.ApiError(str(e)) from None

    # ---- generation ----
    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request):
        body = await body_of(request)
        messages = P.chat_messages(body)
        ids = encode(model.tokenizer.encode_chat, messages)
        return await _generate(request, body, ids, "messages", chat=True)

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request):
        body = await body_of(request)
        ids = encode(P.completion_prompt, body, model.tokenizer, model.cfg.vocab_size)
        return await _generate(request, body, ids, "prompt", chat=False)

    async def _generate(request: Request, body: dict, ids: list[int], param: str, chat: bool):
        P.check_prompt_fits(ids, ctx, param)
        gen = P.sampling(body, ctx, len(ids))
        gen["max_tokens"] = min(gen["max_tokens"], ctx - len(ids) + 1)  # the last one needs no KV slot
        gen["ubatch"] = ubatch
        stream = P.get_bool(body, "stream", False)
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise P.ApiError("'stream_options' must be an object", param="stream_options")
        include_usage = P.get_bool(opts or {}, "include_usage", False)
        job = Job(ids, gen, cache_prompt=P.get_bool(body, "cache_prompt", True))
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        if stream:
            return StreamingResponse(_stream(job, rid, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(request, job, rid, chat)

    def _wire(job: Job) -> asyncio.Queue:
        """Connect the job's worker-thread callbacks to an asyncio queue of ("text"|"done", ...)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, item)

        job.on_text = lambda piece: put(("text", piece))
        job.on_done = lambda res, err: put(("done", res, err))
        return events

    async def _complete(request: Request, job: Job, rid: str, chat: bool):
        events = _wire(job)
        job.on_text = None  # nothing to stream; cancellation is still checked between tokens
        scheduler.submit(job)
        done = False
        try:
            while not done:
                try:
                    item = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; `finally` cancels the job
                    continue
                done = item[0] == "done"
        finally:
            if not done:
                job.cancelled.set()
        _, res, err = item
        _raise_engine_error(err)
        return (P.chat_response if chat else P.completion_response)(rid, served, res)

    async def _stream(job: Job, rid: str, chat: bool, include_usage: bool):
        events = _wire(job)
        created = int(time.time())
        scheduler.submit(job)
        try:
            if chat:
                yield P.sse(P.chat_chunk(rid, served, created, {"role": "assistant", "content": ""}))
            while True:
                item = await events.get()
                if item[0] == "text":
                    piece = item[1]
                    chunk = (P.chat_chunk(rid, served, created, {"content": piece}) if chat
                             else P.completion_chunk(rid, served, created, piece))
                    yield P.sse(chunk)
                    continue
                _, res, err = item
                if err is not None or res is None:
                    e = err if err is not None else RuntimeError("the request was cancelled")
                    yield P.sse(_error_of(e).body())
                    break
                res: GenerationResult
                reason = P.finish_reason(res)
                # The last chunk carries the finish reason and llama-server's timings.
                last = (P.chat_chunk(rid, served, created, {}, reason, timings=res.timings()) if chat
                        else P.completion_chunk(rid, served, created, "", reason, timings=res.timings()))
                yield P.sse(last)
                if include_usage:
                    u = P.usage(res)
                    yield P.sse(P.chat_chunk(rid, served, created, None, usage_=u) if chat
                                else P.completion_chunk(rid, served, created, None, usage_=u))
                break
            yield P.sse("[DONE]")
        finally:
            job.cancelled.set()  # a client that left stops its generation and frees its slot

    # ---- tokens ----
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = P.parse_json(await request.body())
        content = body.get("content")
        if not isinstance(content, str):
            raise P.ApiError(f"'content' must be a string, got {P._type_name(content)}", param="content")
        add_special = P.get_bool(body, "add_special", False)
        ids = model.tokenizer.encode(content, add_special_tokens=add_special)
        if P.get_bool(body, "with_pieces", False):
            return {"tokens": [{"id": i, "piece": model.tokenizer.decode([i], skip_special_tokens=False)}
                               for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = P.parse_json(await request.body())
        ids = P.check_token_ids(body.get("tokens"), model.cfg.vocab_size, "tokens")
        return {"content": model.tokenizer.decode(ids, skip_special_tokens=False)}

    # ---- status ----
    @app.get("/v1/models", dependencies=authorized)
    async def models():
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": int(model.path.stat().st_mtime), "owned_by": "expertcache",
            "meta": {"n_ctx": ctx, "n_ctx_train": model.cfg.max_position, "n_vocab": model.cfg.vocab_size,
                     "n_slots": n_slots}}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/props")
    async def props():  # llama-server's: clients read the context size and slot count here
        return {"default_generation_settings": {"n_ctx": ctx}, "total_slots": n_slots,
                "model_path": str(model.path), "model_alias": served, "cache_prompt": cache_prompt}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    add_dashboard(app, model, scheduler, model_id=served)  # the page at / and /cache/state, /cache/events
    return app


def _error_of(e: BaseException) -> P.ApiError:
    if isinstance(e, P.ApiError):
        return e
    if isinstance(e, ExpertCacheError):
        return P.ApiError(str(e))
    return P.ApiError(f"internal error: {type(e).__name__}: {e}", status=500)


def _raise_engine_error(err: BaseException | None) -> None:
    if err is not None:
        raise _error_of(err)
