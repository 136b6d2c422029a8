"""The ASGI app of `ftjax serve` (FastAPI on uvicorn): routes, body limits, error shapes.

    GET  /health                      liveness + the model id
    GET  /v1/models                   OpenAI model list (with the context length)
    GET  /v1/stats                    expert-cache telemetry, sessions and queue, memory
    POST /v1/chat/completions         OpenAI chat (JSON or SSE)        openai_api.py
    POST /v1/completions              OpenAI text completion
    POST /v1/messages                 Anthropic messages (JSON or SSE) anthropic_api.py
    POST /v1/messages/count_tokens    Anthropic token count

Bodies are read here with a size limit (413 beyond it) and decoded as JSON (400 when
malformed) before an adapter sees them. Every refusal is a `ServeError` rendered in the
error shape of the API its path belongs to; anything unexpected becomes a 500 in the
same shape, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ftjax.serve import anthropic_api, openai_api
from ftjax.serve.core import Engine, ServeError

DEFAULT_MAX_BODY_BYTES = 4 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_body(path: str, e: ServeError) -> dict:
    """The error JSON of the API that `path` belongs to."""
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": e.kind, "message": e.message}}
    code = {"not_found_error": "model_not_found", "request_too_large": "request_too_large"}.get(e.kind)
    kind = e.kind if e.kind in ("invalid_request_error", "api_error") else "invalid_request_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}


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
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()  # on shutdown, before uvicorn re-raises SIGTERM: the state cache's disk tier is written

    app = FastAPI(title="ftjax", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(ServeError)
    async def refused(request: Request, e: ServeError):
        return JSONResponse(error_body(request.url.path, e), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        err = ServeError(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code, kind=kind)
        return JSONResponse(error_body(request.url.path, err), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception):
        print(f"ftjax serve: {request.url.path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        err = ServeError(f"internal error: {type(e).__name__}: {e}", status=500, kind="api_error")
        return JSONResponse(error_body(request.url.path, err), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_id}

    @app.get("/v1/models")
    async def models():
        return openai_api.models(engine)

    @app.get("/v1/stats")
    async def stats():
        return await asyncio.to_thread(engine.stats)

    async def openai_route(request: Request, to_request, respond, chat: bool):
        r, req = to_request(await read_json(request, max_body_bytes), engine)
        gen = engine.generate(req)
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
        gen = engine.generate(req)
        if r.stream:
            return _sse(anthropic_api.stream(engine, gen, keepalive_s))
        return await anthropic_api.response(engine, gen, request.is_disconnected)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return anthropic_api.count_tokens(await read_json(request, max_body_bytes), engine)

    return app


def serve(model, host: str = "127.0.0.1", port: int = 8000, model_id: str = "ftjax-default", max_batch: int = 4,
          prefill_chunk: int = 256, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, keepalive_s: float = 5.0,
          warmup: bool = False, state_cache=None) -> None:
    """Run the server until interrupted; `warmup` compiles the engine's programs first.
    state_cache: an `engine.state_cache.StateCache` or None (off)."""
    import uvicorn

    engine = Engine(model, model_id, max_batch, prefill_chunk, state_cache)
    if warmup:
        print(f"ftjax serve: compiled the engine's programs in {engine.scheduler.warmup():.1f} s", file=sys.stderr,
              flush=True)
    engine.start()
    cache = f"state cache {state_cache.mode}" if state_cache is not None else "no state cache"
    print(f"ftjax serve: {model_id} (context {engine.context}, max batch {max_batch}, {cache}) on http://{host}:{port} "
          f"- OpenAI: {host}:{port}/v1, Anthropic: {host}:{port}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(engine, max_body_bytes, keepalive_s), host=host, port=port, log_level="warning")
    finally:
        engine.close()
