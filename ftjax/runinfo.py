"""Who ran a measurement, where: the commit and machine fields every benchmark line carries.

A benchmark line is only worth keeping when a commit reproduces it, so every runner that
writes raw lines starts with `require_clean(args.allow_dirty)`: on a tree with uncommitted
changes to tracked files (or outside a git checkout) it refuses with the files named,
unless the run was started with `--allow-dirty` (`add_allow_dirty_argument`); such lines
keep `"dirty": true` and the results page never uses them (`scripts/results.py`).

Pure standard library: `scripts/bench_llamacpp.py` loads this file by path in a virtual
environment that has neither jax nor ftjax.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# /proc/cpuinfo flags that decide which kernels run (and which peers' builds can use):
# recorded in every line so that a table names its machine by more than a model string
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
             "asimd", "sve", "sve2")
ALLOW_DIRTY_HELP = ("record even if tracked files have uncommitted changes (or outside a git checkout); the lines "
                    "keep \"dirty\": true and no results table uses them")


class DirtyTreeError(RuntimeError):
    """A benchmark was asked to record from a tree no commit reproduces."""


def _git(*args: str) -> str | None:
    """git's stdout, or None when git is missing, fails, or this is not a checkout."""
    try:
        p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def git_commit() -> str | None:
    """Short hash of HEAD, or None outside a git checkout."""
    return (_git("rev-parse", "--short", "HEAD") or "").strip() or None


def dirty_files() -> list[str] | None:
    """Tracked files with uncommitted changes (`git status --porcelain -uno`), or None when
    that cannot be told (no git, not a checkout)."""
    out = _git("status", "--porcelain", "-uno")
    if out is None:
        return None
    return [line[3:] for line in out.splitlines() if line.strip()]  # "XY path"


def commit_info() -> dict:
    """{"commit": short hash, "dirty": uncommitted changes to tracked files}. Outside a git
    checkout the commit is "unknown" and the tree counts as dirty: nothing reproduces it."""
    files = dirty_files()
    return {"commit": git_commit() or "unknown", "dirty": files is None or bool(files)}


def require_clean(allow_dirty: bool = False) -> dict:
    """`commit_info()` if the tree is clean (or `allow_dirty`); else DirtyTreeError naming
    the changed files. Call it before measuring anything."""
    info = commit_info()
    if not info["dirty"] or allow_dirty:
        return info
    files = dirty_files()
    if files is None:
        what = f"{REPO} is not a git checkout (or git is missing), so no commit reproduces the lines"
    else:
        shown = ", ".join(files[:10]) + (f" and {len(files) - 10} more" if len(files) > 10 else "")
        what = f"uncommitted changes to tracked files at {info['commit']}: {shown}"
    raise DirtyTreeError(f"refusing to record benchmark lines: {what}. Commit (or stash) the changes, or pass "
                         f"--allow-dirty to record anyway (the lines keep \"dirty\": true and no results table "
                         f"uses them).")


def add_allow_dirty_argument(parser) -> None:
    """`--allow-dirty` on an argparse parser (every runner that writes raw lines has it)."""
    parser.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)


def check_clean_or_exit(allow_dirty: bool, prog: str | None = None) -> dict:
    """`require_clean` for a script's main: the refusal goes to stderr, exit status 2."""
    try:
        return require_clean(allow_dirty)
    except DirtyTreeError as e:
        print(f"{prog or Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The ISA flags of `ISA_FLAGS` this CPU reports (Linux /proc/cpuinfo; [] elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def machine_info() -> dict:
    """CPU model and ISA flags, cores, the 1-minute load (benchmarks on a shared machine say
    so), and the kernels' ISA paths (`host.isa_report`: AUTO's, the AMX self-check)."""
    from ftjax.host import isa_report

    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "cores_used": len(os.sched_getaffinity(0)), "loadavg_1m": os.getloadavg()[0], "isa": isa_report()}


def run_fields() -> dict:
    """When and how a line was made: local time and the command line that ran."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    try:
        script = script.resolve().relative_to(REPO)
    except (OSError, ValueError):
        script = Path(script.name)
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": shlex.join([str(script), *sys.argv[1:]])}
