"""Request validation shared by the adapters: strict pydantic models, and the rules for
options a request may carry but this server does not implement.

Strict mode: a string where a number belongs is an error, not a coercion. Unknown
fields are collected (`extra="allow"`) and then either ignored (harmless hints such as
`user` or `metadata`, listed per API) or refused by name.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ftjax.engine.session import Sampling
from ftjax.engine.stops import check_stops
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


SEED_RANGE = (-(2**63), 2**63 - 1)  # what PRNGKey takes (int64)
MAX_TOP_K = 2**31 - 1  # int32 in the step; any k >= the vocabulary means "all tokens"
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def sampling(temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None,
             max_temperature: float) -> Sampling:
    """The sampling settings, each checked here (a value that would fail later, inside a
    step, is refused at the door with the field's name)."""
    t = 1.0 if temperature is None else temperature
    if not (math.isfinite(t) and 0 <= t <= max_temperature):
        raise ServeError(f"bad sampling setting: temperature must be in [0, {max_temperature:g}], got {t:g}",
                         param="temperature")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ServeError(f"bad sampling setting: top_p must be in (0, 1], got {top_p:g}", param="top_p")
    if top_k is not None and not 0 <= top_k <= MAX_TOP_K:
        raise ServeError(f"bad sampling setting: top_k must be in [0, {MAX_TOP_K}] (0 = off), got {top_k}",
                         param="top_k")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ServeError(f"seed must be a 64-bit signed integer ({SEED_RANGE[0]}..{SEED_RANGE[1]}), got {seed}",
                         param="seed")
    return Sampling(t, top_k or 0, 1.0 if top_p is None else top_p, seed or 0)


def stops(value: str | list[str] | None, name: str) -> list[str]:
    try:
        return check_stops([value] if isinstance(value, str) else value, name)
    except ValueError as e:
        raise ServeError(str(e), param=name) from None


def logit_bias(value: dict | None) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} -> {id: bias}; -100 bans
    the token (-inf), as near enough to OpenAI's "effectively banned"."""
    if not value:
        return {}
    if len(value) > MAX_LOGIT_BIAS:
        raise ServeError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(value)}", param="logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ServeError(f"logit_bias: keys are token ids as strings, got {key!r}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ServeError(f"logit_bias[{key}]: the bias must be a number in [-100, 100], got {bias!r}",
                             param="logit_bias")
        out[int(key)] = -math.inf if bias <= -100 else float(bias)
    return out
