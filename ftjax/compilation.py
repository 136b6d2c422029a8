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
default model has a handful of them).

The folder is capped at MAX_BYTES by `prune`, once when a process turns the cache on:
least recently used entries go first (a file's later of access and modification time;
ext4's default `relatime` refreshes the access time of a read entry at least daily), down
to PRUNE_TO of the cap. JAX's own cap (`jax_compilation_cache_max_size`) is left off: a
process with it fails every write into a folder that a process without it has written to
(it reads an `-atime` file beside each entry, and those have none), so a server sharing a
folder with a plain JAX process compiled its prefill and decode programs in every start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

log = logging.getLogger("ftjax")
ENV = "FTJAX_COMPILE_CACHE"
MIN_COMPILE_S = 0.0
JAX_ATIME_SUFFIX = "-atime"  # what jax._src.lru_cache writes beside an entry under its own cap
MAX_BYTES = 2 << 30
PRUNE_TO = 0.75  # of MAX_BYTES, so that pruning is rare


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


def use_folder(folder: str | Path, max_bytes: int = MAX_BYTES) -> str:
    """Cache every program in `folder` (replacing any folder set before), pruned to
    `max_bytes` -> its path."""
    prune(folder, max_bytes)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(folder)


def prune(folder: str | Path, max_bytes: int = MAX_BYTES) -> int:
    """Delete the least recently used entries of a folder holding more than `max_bytes`,
    down to PRUNE_TO of it -> bytes deleted. An entry is its program file plus JAX's
    `-atime` file where one exists; an entry another process deletes first is skipped."""
    entries: dict[str, list] = {}  # key -> [last use, bytes, paths]
    try:
        with os.scandir(folder) as listing:
            for item in listing:
                if not item.is_file() or item.name.startswith("."):
                    continue
                try:
                    stat = item.stat()
                except FileNotFoundError:
                    continue
                entry = entries.setdefault(item.name.removesuffix(JAX_ATIME_SUFFIX), [0.0, 0, []])
                entry[0] = max(entry[0], stat.st_atime, stat.st_mtime)
                entry[1] += stat.st_size
                entry[2].append(item.path)
    except FileNotFoundError:
        return 0
    total = sum(size for _, size, _ in entries.values())
    if total <= max_bytes:
        return 0
    deleted = 0
    for _, size, paths in sorted(entries.values(), key=lambda entry: entry[0]):
        if total - deleted <= PRUNE_TO * max_bytes:
            break
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        deleted += size
    log.info("compilation cache %s: %.0f MB over %.0f MB, deleted the %.0f MB least recently used", folder,
             total / 1e6, max_bytes / 1e6, deleted / 1e6)
    return deleted
