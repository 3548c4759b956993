"""The OpenAI-compatible HTTP API over one loaded model: `create_app(model, ...)` returns a FastAPI
app. Requests are validated here (OpenAI's error shape, 400 for bad input) and queued to the
slot scheduler, whose single worker thread is the only code that runs the model."""

from __future__ import annotations

import asyncio
import contextlib
import time
from functools import partial

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import GenerationResult, Model
from ..errors import ExpertCacheError
from . import protocol as P
from .auth import require_api_key
from .dashboard import add_dashboard
from .limits import MAX_BODY_BYTES, read_body
from .metrics import make_registry
from .slots import MAX_QUEUE, Job, Scheduler

# While a non-streaming request waits, how often to check whether its client left.
DISCONNECT_POLL_S = 0.1


def create_app(model: Model, *, model_id: str | None = None, n_slots: int = 1, cache_prompt: bool = True,
               ubatch: int = 512, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               cors_origins: tuple[str, ...] = ("*",), max_queue: int = MAX_QUEUE) -> FastAPI:
    """An app serving `model` under `model_id` (default: the model directory's name) with
    `n_slots` slots of `model.ctx_size` tokens each; the worker runs while the app runs. With
    `api_key`, every route but /health wants it as a bearer token (see auth.py); a request body
    over `max_body_bytes` is refused with 413, and one that would wait behind `max_queue` others
    with 503. Pages of `cors_origins` ("*": any) may call it from a browser."""
    if model.tokenizer is None:
        raise ExpertCacheError(f"{model.path}: the server needs a tokenizer (tokenizer.json)")
    scheduler = Scheduler(model, n_slots, cache_prompt, max_queue)
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
    if cors_origins:
        # A browser asks before a page of another origin may call the API (a preflight, with no
        # key); the answer lets it send the key and JSON, as llama-server's and vLLM's do.
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    authorized = [Depends(require_api_key)]
    registry = make_registry(model, scheduler)

    # ---- errors: always OpenAI's shape ----
    @app.exception_handler(P.ApiError)
    async def api_error(request, e: P.ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return JSONResponse(P.error_body(f"invalid request: {e.errors()}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        # Name what was asked for (and, for 405, what the route takes); keep the exception's
        # headers: a 405 must say `Allow`.
        where, allow = f"{request.method} {request.url.path}", (e.headers or {}).get("Allow")
        message = {404: f"{where}: no such route or file",
                   405: f"{where}: method not allowed" + (f"; this route takes {allow}" if allow else "")
                   }.get(e.status_code, f"{where}: {e.detail}")
        return JSONResponse(P.error_body(message, param=None, code=code), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    async def json_of(request: Request) -> dict:
        # Parsed and checked on a thread: walking a body of millions of values takes a while.
        return await asyncio.to_thread(P.parse_json, await read_body(request, max_body_bytes))

    async def body_of(request: Request) -> dict:
        body = await json_of(request)
        P.check_model(body, served)
        return body

    async def off_loop(param: str, fn, *args):
        """Run a template or the tokenizer in a thread: the event loop keeps answering meanwhile."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ExpertCacheError as e:  # a chat template that refuses the messages, text it cannot encode
            raise P.ApiError(str(e), param=param) from None

    # ---- generation ----
    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request):
        body = await body_of(request)
        gen, stream, include_usage = _options(body, chat=True)
        messages = P.chat_messages(body, developer=P.knows_developer(model.tokenizer.chat_template))
        variables = P.template_kwargs(body)
        ids = await off_loop("messages", partial(model.tokenizer.encode_chat, **variables), messages)
        return await _generate(request, body, ids, gen, stream, include_usage, "messages", chat=True)

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request):
        body = await body_of(request)
        gen, stream, include_usage = _options(body, chat=False)
        ids = await off_loop("prompt", P.completion_prompt, body, model.tokenizer, model.cfg.vocab_size)
        return await _generate(request, body, ids, gen, stream, include_usage, "prompt", chat=False)

    def _options(body: dict, chat: bool) -> tuple[dict, bool, bool]:
        """Every field but the prompt, checked before the prompt is rendered and tokenized."""
        P.check_fields(body, chat)
        gen = P.sampling(body, ctx, chat)
        gen["ubatch"] = ubatch
        stream = P.get_bool(body, "stream", False)
        return gen, stream, P.stream_options(body, stream)

    async def _generate(request: Request, body: dict, ids: list[int], gen: dict, stream: bool,
                        include_usage: bool, param: str, chat: bool):
        P.check_prompt_fits(ids, ctx, param)
        P.limit_tokens(gen, ctx, len(ids), param)
        job = Job(ids, gen, cache_prompt=P.get_bool(body, "cache_prompt", True))
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        events = _wire(job)
        if not stream:
            job.on_text = None  # nothing to stream; cancellation is still checked between tokens
        scheduler.submit(job)
        # Nothing is sent before the worker's first event: an error in the prompt's processing is
        # still an HTTP status, for a stream too.
        first = await _next_event(request, job, events)
        if first is None:
            return Response(status_code=499)  # the client left; the job is cancelled
        if first[0] == "done":
            _raise_engine_error(first[2])
            if first[1] is None:  # cancelled unrun by someone else (a shutdown says ShuttingDown, a 503 too)
                raise P.ApiError("the request was cancelled", status=503, code="cancelled")
        if not stream:
            while first[0] != "done":
                first = await _next_event(request, job, events)
                if first is None:
                    return Response(status_code=499)
            _, res, err = first
            _raise_engine_error(err)
            return (P.chat_response if chat else P.completion_response)(rid, served, res)
        return StreamingResponse(_stream(job, events, first, rid, chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

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

    async def _next_event(request: Request, job: Job, events: asyncio.Queue):
        """The job's next event, or None (and the job cancelled) when the client leaves first."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return None
            except BaseException:  # the server is shutting down the request
                job.cancelled.set()
                raise

    async def _stream(job: Job, events: asyncio.Queue, item, rid: str, chat: bool, include_usage: bool):
        created = int(time.time())

        def chunk(delta: dict | str, finish: str | None = None, timings: dict | None = None) -> bytes:
            """A chat delta or a completion's text; with include_usage, "usage": null as OpenAI's."""
            c = (P.chat_chunk(rid, served, created, delta, finish, timings=timings) if chat
                 else P.completion_chunk(rid, served, created, delta, finish, timings=timings))
            if include_usage:
                c["usage"] = None
            return P.sse(c)

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            # The engine's pieces never hold the start of a stop string (`Model.generate` holds it
            # back until it is ruled out) and add up to the answer's text: a stream is the same text.
            while item[0] == "text":
                yield chunk({"content": item[1]} if chat else item[1])
                item = await events.get()
            _, res, err = item
            if err is not None or res is None:
                e = err if err is not None else RuntimeError("the request was cancelled")
                yield P.sse(_error_of(e).body())
            else:
                res: GenerationResult
                # The last chunk carries the finish reason and llama-server's timings.
                yield chunk({} if chat else "", P.finish_reason(res), timings=res.timings())
                if include_usage:
                    u = P.usage(res)
                    yield P.sse(P.chat_chunk(rid, served, created, None, usage_=u) if chat
                                else P.completion_chunk(rid, served, created, None, usage_=u))
            yield P.sse("[DONE]")
        finally:
            job.cancelled.set()  # a client that left stops its generation and frees its slot

    # ---- tokens ----
    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(request: Request):
        body = await json_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise P.ApiError(f"'content' must be a string, got {P._type_name(content)}", param="content")
        add_special = P.get_bool(body, "add_special", False)
        with_pieces = P.get_bool(body, "with_pieces", False)
        # llama-server's: off, text that spells a special token is tokenized as plain characters.
        parse_special = P.get_bool(body, "parse_special", True)

        def run():
            ids = model.tokenizer.encode(content, add_special_tokens=add_special, parse_special=parse_special)
            if with_pieces:
                # llama-server's pieces: each token's own bytes (decoding it alone drops a word's leading
                # space and turns a byte into U+FFFD), as text or, where not UTF-8, as byte values.
                return [{"id": i, "piece": model.tokenizer.piece(i)} for i in ids]
            return ids

        return {"tokens": await off_loop("content", run)}

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(request: Request):
        body = await json_of(request)
        ids = P.check_token_ids(body.get("tokens"), model.cfg.vocab_size, "tokens")
        return {"content": await off_loop("tokens", model.tokenizer.decode, ids, False)}

    # ---- status ----
    created = int(model.path.stat().st_mtime)

    def card() -> dict:
        return {"id": served, "object": "model", "created": created, "owned_by": "expertcache"}

    @app.get("/v1/models", dependencies=authorized)
    async def models():
        return {"object": "list", "data": [{**card(), "meta": {
            "n_ctx": ctx, "n_ctx_train": model.cfg.max_position, "n_vocab": model.cfg.vocab_size, "n_slots": n_slots}}]}

    @app.get("/v1/models/{name:path}", dependencies=authorized)
    async def model_card(name: str):  # as OpenAI's: the model object, or 404 model_not_found
        if name != served:
            raise P.ApiError(f"The model '{name}' does not exist", status=404, param="model", code="model_not_found")
        return card()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/props", dependencies=authorized)
    async def props():  # llama-server's: clients read the context size and slot count here
        return {"default_generation_settings": {"n_ctx": ctx}, "total_slots": n_slots,
                "model_path": str(model.path), "model_alias": served, "cache_prompt": cache_prompt}

    @app.get("/metrics", dependencies=authorized)  # usage figures are data too (Prometheus sends a bearer token)
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    add_dashboard(app, model, scheduler, model_id=served)  # the page at / and /cache/state, /cache/events
    return app


def _error_of(e: BaseException) -> P.ApiError:
    """The API's answer to an error from the engine. An ExpertCacheError is the request's fault
    (400) unless its class says otherwise with `status` and `code` attributes (the weights
    changing under a request: 503 `model_changed`; a checkpoint that could not be read: 500), and
    `retry_after` seconds (a full queue)."""
    if isinstance(e, P.ApiError):
        return e
    if isinstance(e, ExpertCacheError):
        retry = getattr(e, "retry_after", None)
        return P.ApiError(str(e), status=getattr(e, "status", 400), code=getattr(e, "code", None),
                          headers=None if retry is None else {"Retry-After": str(retry)})
    return P.ApiError(f"internal error: {type(e).__name__}: {e}", status=500)


def _raise_engine_error(err: BaseException | None) -> None:
    if err is not None:
        raise _error_of(err)
