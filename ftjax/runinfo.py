"""Who ran a measurement, where: the commit and machine fields every benchmark line carries."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str | None:
    """Short hash of HEAD, or None outside a git checkout."""
    return _git("rev-parse", "--short", "HEAD") or None


def commit_info() -> dict:
    """{"commit": short hash, "dirty": uncommitted changes to tracked files}."""
    return {"commit": git_commit() or "unknown", "dirty": bool(_git("status", "--porcelain", "-uno"))}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """CPU model, cores, and the 1-minute load (benchmarks on a shared machine say so)."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
            "loadavg_1m": os.getloadavg()[0]}
