"""`ftjax serve`: OpenAI- and Anthropic-compatible HTTP serving on the session engine.

    core.py           protocol-neutral: request -> token stream -> reasoning / text / tool calls
    schemas.py        strict request validation shared by the adapters
    openai_api.py     /v1/chat/completions, /v1/completions, /v1/models
    anthropic_api.py  /v1/messages, /v1/messages/count_tokens
    app.py            the FastAPI app, body limits, error shapes; serve()

Continuous batching lives in `ftjax.engine.scheduler`.
"""

from ftjax.serve.app import create_app, serve
from ftjax.serve.core import Engine

__all__ = ["Engine", "create_app", "serve"]
