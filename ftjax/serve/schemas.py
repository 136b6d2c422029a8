"""Request validation shared by the adapters: strict pydantic models, and the rules for
options a request may carry but this server does not implement.

Strict mode: a string where a number belongs is an error, not a coercion. Unknown
fields are collected (`extra="allow"`) and then either ignored (harmless hints such as
`user` or `metadata`, listed per API) or refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ftjax.engine.session import Sampling
from ftjax.serve.core import ServeError


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; errors name each bad field."""
    if not isinstance(body, dict):
        raise ServeError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        parts = []
        for err in e.errors()[:4]:
            where = ".".join(str(x) for x in err["loc"]) or "body"
            parts.append(f"{where}: {err['msg']}" + (f" (got {json.dumps(err['input'])[:60]})"
                                                      if err["type"] != "missing" else ""))
        raise ServeError("invalid request: " + "; ".join(parts), param=".".join(map(str, e.errors()[0]["loc"])))


def refuse_unknown(req: Open, ignored: set[str]) -> None:
    """Fields neither modelled nor harmless to ignore: refused, by name."""
    unknown = sorted(set(req.model_extra or {}) - ignored)
    if unknown:
        raise ServeError(f"unsupported option(s): {', '.join(unknown)}", param=unknown[0])


def refuse_values(**settings: tuple[Any, Any]) -> None:
    """Options accepted only at a neutral value: name=(value, neutral) -> refuse others."""
    for name, (value, neutral) in settings.items():
        if value is not None and value != neutral:
            raise ServeError(f"unsupported option: {name}={json.dumps(value)} (this server supports only "
                             f"{json.dumps(neutral)})", param=name)


def sampling(temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None,
             max_temperature: float) -> Sampling:
    t = 1.0 if temperature is None else temperature
    if t > max_temperature:
        raise ServeError(f"bad sampling setting: temperature must be in [0, {max_temperature:g}], got {t:g}",
                         param="temperature")
    try:
        return Sampling(t, top_k or 0, 1.0 if top_p is None else top_p, seed or 0)
    except ValueError as e:
        raise ServeError(str(e), param="sampling") from None


def stops(value: str | list[str] | None, name: str) -> list[str]:
    out = [value] if isinstance(value, str) else list(value or [])
    if any(not s for s in out):
        raise ServeError(f"{name}: stop strings must not be empty", param=name)
    return out
