"""`expertcache serve`: the OpenAI-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from ..errors import ExpertCacheError
from ..server.limits import MAX_BODY_BYTES
from ..server.slots import MAX_QUEUE
from .args import byte_count, open_listener_warning
from ..flags import add_cache_flags, nonneg_int, positive_int
from .common import add_model_flags, load_model


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ExpertCacheError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ExpertCacheError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from ..server.app import create_app
        from ..server.auth import read_api_key
    except ImportError as e:
        raise ExpertCacheError(f"the server needs the [server] extra ({e.name} is missing): "
                               "pip install 'expertcache[server]'") from None
    if not 0 <= args.port <= 65535:
        raise ExpertCacheError(f"--port {args.port} must be in 0..65535")
    if args.alias is not None and not args.alias.strip():
        # An empty id would fall back to the directory's name without a word.
        raise ExpertCacheError(f"--alias {args.alias!r}: expected a model id (leave it out for the model's name)")
    api_key = read_api_key(args.api_key, args.api_key_file)
    sock = _listen(args.host, args.port)  # before loading: a busy port fails fast
    host, port = sock.getsockname()[:2]
    warning = open_listener_warning(host, api_key is not None)
    if warning:
        print(f"expertcache: warning: {warning}", file=sys.stderr, flush=True)
    try:
        model = load_model(args)
        app = create_app(model, model_id=args.alias, n_slots=args.parallel, cache_prompt=not args.no_cache_prompt,
                         ubatch=args.ubatch, api_key=api_key, max_body_bytes=args.max_body_bytes,
                         cors_origins=args.cors_origins, max_queue=args.max_queue)
    except BaseException:
        sock.close()  # the port is free again for a caller that goes on (cli.main in-process, tests)
        raise
    print(f"expertcache: serving '{app.state.model_id}' on http://{host}:{port} "
          f"({args.parallel} slot(s) of {model.ctx_size} tokens, prompt cache "
          f"{'off' if args.no_cache_prompt else 'on'}, cache mode {model.telemetry().get('mode')}, "
          f"API key {'required' if api_key else 'off'})",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                            timeout_graceful_shutdown=5)
    _ending_requests_first(uvicorn.Server)(config).run(sockets=[sock])
    return 0


def _ending_requests_first(server_class):
    """uvicorn's server, which on Ctrl-C or SIGTERM first ends the app's requests: the scheduler's
    stop() answers those queued or running (and any submitted later) with 503
    `server_shutting_down`, a stream with a last error event, the generation stopping at its next
    token. Their connections then close long before uvicorn's grace period, after which it would
    cancel them mid-response (a bare 500, a cut stream, tracebacks in the log). The lifespan's
    own shutdown comes only after that period, too late for this."""

    class Server(server_class):
        async def shutdown(self, sockets=None):
            await asyncio.to_thread(self.config.app.state.scheduler.stop)
            await super().shutdown(sockets)

    return Server


def _origins(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in origins:
        if o != "*" and not (o.startswith(("http://", "https://")) and "/" not in o.split("://", 1)[1]):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin: expected '*' or scheme://host[:port], "
                                             "e.g. http://localhost:3000")
    return origins


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a prompt cache")
    add_model_flags(p)
    add_cache_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    p.add_argument("-np", "--parallel", type=positive_int, default=1,
                   help="slots: conversations whose KV state is kept; they run in turn (default: 1)")
    p.add_argument("--no-cache-prompt", action="store_true",
                   help="do not reuse a slot's KV state for a common prompt prefix")
    p.add_argument("-a", "--alias", help="model id the API reports (default: the model directory's name, or the GGUF file's "
                                            "with .gguf)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: none)")
    p.add_argument("--api-key-file", metavar="PATH", help="read the API key from the first line of a file")
    p.add_argument("--max-body-bytes", type=byte_count, default=MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body; larger ones get 413 (default: {MAX_BODY_BYTES // 2**20}MiB; "
                        "units KiB, MiB, GiB allowed)")
    p.add_argument("--max-queue", type=nonneg_int, default=MAX_QUEUE, metavar="N",
                   help="requests that may wait while one runs; more are refused with 503 and Retry-After "
                        f"(default: {MAX_QUEUE}; 0: none wait)")
    p.add_argument("--cors-origins", type=_origins, default=("*",), metavar="ORIGINS",
                   help="web origins whose pages may call the API from a browser, comma-separated, e.g. "
                        "http://localhost:3000; '*' any (default, as llama-server and vLLM), '' none")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default: warning)")
    p.set_defaults(func=cmd_serve)
