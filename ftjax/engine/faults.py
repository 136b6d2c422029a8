"""Named fault points: make the engine fail on purpose, where real failures happen.

Recovery code that never runs is recovery code that does not work. The engine calls
`check(point)` at each place where a real failure can strike; a test (or an operator
reproducing an incident) arms a point, and the next `times` passes through it raise
`InjectedFault`. Unarmed, a check is one dict lookup.

    point           where                                       what a real failure there is
    prefill         Model.prefill_step, after the program ran   a device error mid-prompt
    decode          Model.decode_step, after the program ran    a device error mid-batch
                    (the donated state and expert cache are gone, as after a real failure)
    restore         StateCache.restore, before joining segments a device allocation failure
    snapshot_write  StateCache, writing a node to the disk tier a full or failing disk
    disk_read       StateCache, reading a node from the disk tier a corrupt or vanished file

The host kernels have their own switch (`ftjax.host.inject_host_fault`): the fault is
raised inside the C++ handler, through the same FFI error path as a real one.

Arming: `arm("decode", times=1)` in process, or `FTJAX_FAULTS="decode:1,restore:2"` in
the environment of a process (read once, at import), e.g. a server under test.
"""

from __future__ import annotations

import os
import threading

POINTS = ("prefill", "decode", "restore", "snapshot_write", "disk_read")


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


_lock = threading.Lock()
_armed: dict[str, int] = {}


def arm(point: str, times: int = 1) -> None:
    """The next `times` checks of `point` raise InjectedFault (0 disarms)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if not isinstance(times, int) or times < 0:
        raise ValueError(f"times must be an integer >= 0, got {times!r}")
    with _lock:
        if times:
            _armed[point] = times
        else:
            _armed.pop(point, None)


def disarm() -> None:
    with _lock:
        _armed.clear()


def check(point: str) -> None:
    if not _armed:
        return
    with _lock:
        left = _armed.get(point, 0)
        if not left:
            return
        if left == 1:
            del _armed[point]
        else:
            _armed[point] = left - 1
    raise InjectedFault(f"injected fault at {point!r} (ftjax.engine.faults)")


def arm_from_env(spec: str | None = None) -> None:
    """Arm points from "point:times,point:times" ($FTJAX_FAULTS by default)."""
    spec = os.environ.get("FTJAX_FAULTS", "") if spec is None else spec
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, times = item.partition(":")
        try:
            arm(point, int(times or 1))
        except ValueError as e:
            raise ValueError(f"FTJAX_FAULTS={spec!r}: {e}") from None


arm_from_env()
