"""The ASGI app of `ftjax serve` (FastAPI on uvicorn): routes, body limits, error shapes.

    GET  /health                      200 {"status": "ok"}; 503 while "draining" or
                                      "degraded" (with the reason)
    GET  /metrics                     Prometheus text format (serve/metrics.py)
    GET  /v1/models                   OpenAI model list (with the context length)
    GET  /v1/stats                    expert-cache telemetry, sessions and queue, memory
    POST /v1/chat/completions         OpenAI chat (JSON or SSE)        openai_api.py
    POST /v1/completions              OpenAI text completion
    POST /v1/messages                 Anthropic messages (JSON or SSE) anthropic_api.py
    POST /v1/messages/count_tokens    Anthropic token count

Bodies are read here with a size limit (413 beyond it) and decoded as JSON (400 when
malformed) before an adapter sees them. Every refusal is a `ServeError` rendered in the
error shape of the API its path belongs to — a full queue is 429 `rate_limit_error`
(OpenAI) or 529 `overloaded_error` (Anthropic), with Retry-After — and anything
unexpected becomes a 500 in the same shape, logged with its traceback, and the server
keeps serving. A request may shorten its deadline with `X-Request-Timeout: SECONDS`
(never beyond the server's `--request-timeout-s`).

Shutdown (SIGTERM or Ctrl-C): the server stops admitting at once (503), gives what is
queued or running `--drain-s` seconds to finish, then ends the rest with an error, so
every client gets an answer and the process exits; a second signal exits at once.

Several processes (`--coordinator`, `ftjax.distributed`): every process runs `serve`
with the same options; process 0 listens and schedules, the others run its steps
(`engine.replica`; their settings are checked against process 0's before any step).
When a peer process is lost, the requests in flight end with an error naming it and
the server exits; stopping process 0 stops the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ftjax import distributed
from ftjax.engine import replica
from ftjax.engine.scheduler import DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK
from ftjax.serve import anthropic_api, openai_api
from ftjax.serve.core import DEFAULT_DRAIN_S, DEFAULT_REQUEST_TIMEOUT_S, Engine, ServeError
from ftjax.serve.metrics import Metrics

log = logging.getLogger("ftjax.serve")
DEFAULT_MAX_BODY_BYTES = 4 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, e: ServeError) -> JSONResponse:
    """The error JSON and status of the API that `path` belongs to."""
    status = e.status
    if anthropic_path(path):
        body = anthropic_api.error_json(e)
        if e.kind == "overloaded_error" and status == 429:
            status = 529  # Anthropic's "overloaded"
    else:
        body = openai_api.error_json(e)
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(body, status_code=status, headers=headers)


def request_timeout(request: Request) -> float | None:
    """X-Request-Timeout: seconds (a positive number), or None."""
    value = request.headers.get("x-request-timeout")
    if value is None:
        return None
    try:
        t = float(value)
    except ValueError:
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise ServeError(f"X-Request-Timeout must be a positive number of seconds, got {value!r}",
                         param="X-Request-Timeout")
    return t


async def read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes (declared or actual), 400 when not JSON."""
    declared = request.headers.get("content-length")
    too_large = ServeError(f"request body larger than the limit of {limit} bytes (--max-body-bytes)", status=413,
                           kind="request_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServeError(f"malformed JSON body: {e}") from None


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def create_app(engine: Engine, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, keepalive_s: float = 5.0) -> FastAPI:
    metrics = Metrics(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()  # on shutdown, before uvicorn re-raises SIGTERM: the state cache's disk tier is written

    app = FastAPI(title="ftjax", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(ServeError)
    async def refused(request: Request, e: ServeError):
        metrics.refused(e)
        return error_response(request.url.path, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        err = ServeError(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code, kind=kind)
        return error_response(request.url.path, err)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception):
        log.error("%s %s: internal error", request.method, request.url.path, exc_info=e)
        err = ServeError(f"internal error: {type(e).__name__}: {e}", status=500, kind="api_error")
        metrics.refused(err)
        return error_response(request.url.path, err)

    @app.get("/health")
    async def health():
        h = engine.health()
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = await asyncio.to_thread(metrics.render)
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return openai_api.models(engine)

    @app.get("/v1/stats")
    async def stats():
        return await asyncio.to_thread(engine.stats)

    async def start(request: Request, req):
        req.timeout_s = request_timeout(request)
        gen = await engine.generate(req)
        metrics.started(gen)
        return gen

    async def openai_route(request: Request, to_request, respond, chat: bool):
        r, req = to_request(await read_json(request, max_body_bytes), engine)
        gen = await start(request, req)
        if r.stream:
            usage = bool(r.stream_options and r.stream_options.include_usage)
            return _sse(openai_api.stream(engine, gen, usage, keepalive_s, chat=chat))
        return await respond(engine, gen, request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai_route(request, openai_api.chat_request, openai_api.chat_response, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_route(request, openai_api.completion_request, openai_api.completion_response, chat=False)

    @app.post("/v1/messages")
    async def messages(request: Request):
        r, req = anthropic_api.messages_request(await read_json(request, max_body_bytes), engine)
        gen = await start(request, req)
        if r.stream:
            return _sse(anthropic_api.stream(engine, gen, keepalive_s))
        return await anthropic_api.response(engine, gen, request.is_disconnected)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await anthropic_api.count_tokens(await read_json(request, max_body_bytes), engine)

    return app


def serve(model, host: str = "127.0.0.1", port: int = 8000, model_id: str = "ftjax-default", max_batch: int = 4,
          prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          keepalive_s: float = 5.0, warmup: bool = False, state_cache=None, max_queue: int = DEFAULT_MAX_QUEUE,
          request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, drain_s: float = DEFAULT_DRAIN_S,
          idle_reprefill: bool = True) -> None:
    """Run the server until SIGTERM / Ctrl-C; `warmup` compiles the engine's programs first.
    state_cache: an `engine.state_cache.StateCache` or None (off); idle_reprefill: prefill
    each conversation's predicted next history while idle (`Engine`)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    role = replica.for_this_process()  # several processes: process 0 serves, the others follow its steps
    engine = Engine(model, model_id, max_batch, prefill_chunk, state_cache, max_queue, request_timeout_s,
                    idle_reprefill, role)
    if role is not None:
        role.handshake(engine.settings(warmup=warmup), distributed.timeout_s())
    if warmup:
        print(f"ftjax serve: compiled the engine's programs in {engine.scheduler.warmup():.1f} s", file=sys.stderr,
              flush=True)
    if role is not None and role.follower:
        print(f"ftjax serve: process {role.pid} runs process 0's steps", file=sys.stderr, flush=True)
        engine.follow()
        role.done()
        distributed.exit(0)  # now, before process 0 (and the coordination service) is gone
    engine.start()
    cache = f"state cache {state_cache.mode}" if state_cache is not None else "no state cache"
    print(f"ftjax serve: {model_id} (context {engine.context}, max batch {max_batch}, {cache}) on http://{host}:{port} "
          f"- OpenAI: {host}:{port}/v1, Anthropic: {host}:{port}", file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # first signal: drain (off the signal handler: it takes locks)
            if not self.should_exit:
                threading.Thread(target=engine.shutdown, args=(drain_s,), daemon=True).start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(engine, max_body_bytes, keepalive_s), host=host, port=port,
                            log_level="warning", timeout_graceful_shutdown=int(math.ceil(drain_s)) + 5)
    server = Server(config)
    engine.on_lost = lambda error: setattr(server, "should_exit", True)  # its requests have their errors
    try:
        server.run()
    finally:
        engine.close()
    if engine.scheduler.lost is not None:
        raise engine.scheduler.lost  # a peer process is gone: the CLI names it and exits
