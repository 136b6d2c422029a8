"""Who ran a measurement, where: the commit and machine fields every benchmark line carries."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit_info() -> dict:
    """{"commit": short hash, "dirty": uncommitted changes to tracked files}."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain", "-uno"))}


def machine_info() -> dict:
    """CPU model, cores, and the 1-minute load (benchmarks on a shared machine say so)."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        cpu = "?"
    return {"cpu": cpu, "cores": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
            "loadavg_1m": os.getloadavg()[0]}
