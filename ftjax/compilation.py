"""XLA's persistent compilation cache, on by default (the CLI, the server and `load()`).

A restarted process would otherwise compile every program again (the default model's
decode and prefill programs: seconds; a large model's: minutes), and the first prompt of
each new length would pay its compile in every process. The cache is keyed by the whole
program, the jaxlib version and the backend; no ftjax program holds a host address (the
FFI handlers find the expert pool by a registered id, `host_kernels/registry.h`), so a
model compiles to the same program in every process and a later one loads it.

    FTJAX_COMPILE_CACHE unset    $XDG_CACHE_HOME/ftjax/xla (~/.cache/ftjax/xla)
    FTJAX_COMPILE_CACHE=DIR      that folder
    FTJAX_COMPILE_CACHE=0        no persistent cache ("off" too)

A folder the process already gave JAX (`jax_compilation_cache_dir`, or
`JAX_COMPILATION_CACHE_DIR`) is left as it is. Every program is written, the small ones
too: a restarted process looks each one up anyway, and reading a small program back
(~2 ms) beats compiling it (~10 ms; a restarted first prompt of 2,048 tokens on the
default model has a handful of them). The folder is capped at MAX_BYTES, least recently
used entries going first.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

log = logging.getLogger("ftjax")
ENV = "FTJAX_COMPILE_CACHE"
MIN_COMPILE_S = 0.0
MAX_BYTES = 2 << 30


def default_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftjax" / "xla"


def enable_persistent_cache() -> str | None:
    """Turn the cache on as $FTJAX_COMPILE_CACHE says -> the folder in use (None: off)."""
    if jax.config.jax_compilation_cache_dir:  # the process's own choice
        return jax.config.jax_compilation_cache_dir
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("0", "off"):
        return None
    folder = Path(setting).expanduser() if setting else default_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: run without the cache rather than fail
        log.warning("compilation cache off: cannot create %s (%s); set %s to a writable folder", folder, e, ENV)
        return None
    return use_folder(folder)


def use_folder(folder: str | Path) -> str:
    """Cache every program in `folder` (replacing any folder set before) -> its path."""
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return str(folder)
