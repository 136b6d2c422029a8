"""Several processes, one model: `jax.distributed` over localhost or real addresses.

Every process calls `connect` (the same coordinator address, its own process id) before
loading, then `ftjax.load(..., devices=jax.device_count())`: the mesh spans every
process's devices (`ftjax.placement`), each process's devices own their share of the
experts (e % P), and the per-layer sum of partial outputs is a collective between the
processes (gloo on the CPU backend, NCCL on GPUs) that XLA emits from the sharding; no
shared memory is assumed between processes, so the same code runs across machines.

The processes run the same program (SPMD, as JAX's multi-controller model has it):
each calls `generate` with the same prompt and settings and gets the same tokens.

Failure is explicit and bounded:
- a process that does not join within `timeout_s` -> `DistributedError` in every
  process that did, naming the coordinator, the timeout and this process;
- a process that dies mid-run -> the next step's collective fails at once (the peer's
  connection closes); `step_error` turns that into `PeerLost`, naming the processes the
  coordination service no longer sees (polled for up to `timeout_s`). A surviving
  process cannot run steps without its peers: it reports and ends with `exit(code)`
  (JAX's own exit-time shutdown would wait on the dead peer and then abort).
- process 0 dies -> the coordination service (which runs in it) goes too, and each
  other process's coordination client aborts its process from a C++ thread, whatever
  Python is doing; the abort prints that process 0 is gone and exits with EXIT_CODE
  (`_host_kernels.exit_on_abort`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

import jax

_timeout_s: float = 60.0
EXIT_CODE = 3  # a process that ends because another is gone (`exit`)


class DistributedError(RuntimeError):
    """The processes of a distributed model could not start or keep running together."""


class PeerLost(DistributedError):
    """A step failed because another process of the model is gone."""


def active() -> bool:
    return jax.process_count() > 1


def timeout_s() -> float:
    """How long a process waits for the others (`connect`'s timeout_s)."""
    return _timeout_s


def connect(coordinator: str, num_processes: int, process_id: int, timeout_s: float = 60.0) -> None:
    """Join the model's processes (before `ftjax.load` and before any JAX computation).
    coordinator: "host:port" that process 0 listens on and every process reaches."""
    global _timeout_s
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id!r}")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator must be host:port, got {coordinator!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    _timeout_s = float(timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU backend's (GPUs bring NCCL)
    _start(coordinator, num_processes, process_id, max(1, int(timeout_s)))


def _start(coordinator: str, num_processes: int, process_id: int, timeout_s: int) -> None:
    """`jax.distributed.initialize`, with what it does not expose: the coordination
    service is `recoverable` (a task that dies is reported to the others, which go on to
    name it, instead of being failed with it) and the client has its own error callback,
    so that neither a join timeout nor a dead peer aborts this process (the default
    callback logs FATAL). The service, client and ids go where JAX's backends look for
    them (`jax._src.distributed.global_state`: the gloo collectives and
    `jax.process_count()` read them)."""
    from jax._src import distributed as jax_distributed
    from jax._src.lib import _jax

    state = jax_distributed.global_state
    if state.client is not None:
        raise DistributedError("this process already joined a distributed model (connect is called once)")
    port = coordinator.rpartition(":")[2]
    try:
        if process_id == 0:
            state.service = _jax.get_distributed_runtime_service(
                f"[::]:{port}", num_processes, heartbeat_timeout=timeout_s, shutdown_timeout=timeout_s,
                recoverable=True)
        client = _jax.get_distributed_runtime_client(
            coordinator, process_id, init_timeout=timeout_s, heartbeat_timeout=timeout_s, use_compression=True,
            missed_heartbeat_callback=_peer_error_seen, shutdown_on_destruction=False)
        client.connect()
    except Exception as e:
        state.service = None
        why = "" if "bad_cast" in str(e) else f" ({type(e).__name__}: {first_line(e)})"  # the callback's own cast
        raise DistributedError(f"process {process_id} of {num_processes}: the processes did not all join "
                               f"{coordinator} within {timeout_s} s{why}") from e
    state.client, state.process_id, state.num_processes = client, process_id, num_processes
    state.coordinator_address, state.partition_index = coordinator, None
    if process_id != 0:  # the service lives in process 0: when it goes, the client aborts this process
        from ftjax import _host_kernels

        _host_kernels.exit_on_abort(
            f"error: process {process_id} of {num_processes}: aborted by its coordination client, which lost the "
            f"service in process 0 ({coordinator}): process 0 is gone, and this process cannot continue without "
            f"it (if process 0 still runs, the abort had another cause: see above)", EXIT_CODE)


def _peer_error_seen(*_) -> None:
    """The coordination client's error callback: the error itself reaches us through
    the failed step (`step_error`); this only keeps the default, which aborts."""


def live_processes() -> list[int]:
    """The process ids the coordination service still sees alive."""
    from jax._src import distributed as jax_distributed  # the client jax.distributed made

    client = jax_distributed.global_state.client
    ids = list(range(jax.process_count()))
    if client is None:
        return ids
    return sorted(int(i) for i in client.get_live_nodes(ids))


def gone_processes() -> set[int]:
    """The process ids the coordination service no longer sees alive."""
    return set(range(jax.process_count())) - set(live_processes())


def peer_lost(gone: set[int], cause: str) -> PeerLost:
    """`PeerLost` from this process's view: which processes are gone, and how it showed."""
    names = ", ".join(str(i) for i in sorted(gone))
    return PeerLost(f"process {jax.process_index()} of {jax.process_count()}: process {names} is gone ({cause}); "
                    f"this process cannot continue without it")


def step_error(error: Exception) -> Exception:
    """What a failed step means when several processes run the model: `PeerLost`
    naming the processes that are gone (the coordination service's view, polled up to
    the timeout), or the error itself when every process is still there."""
    if not active() or isinstance(error, DistributedError):
        return error
    deadline = time.monotonic() + _timeout_s
    gone: set[int] = set()
    while time.monotonic() < deadline:
        try:
            gone = gone_processes()
        except Exception as e:  # the coordinator itself is gone (it runs in process 0)
            gone = {0} if jax.process_index() != 0 else set()
            if gone:
                break
            raise PeerLost(f"process {jax.process_index()}: the coordination service does not answer "
                           f"({first_line(e)}); the step failed: {first_line(error)}") from error
        if gone:
            break
        if "gloo" not in str(error).lower() and "collective" not in str(error).lower():
            return error  # not a collective failure, and everyone is alive: the step's own error
        time.sleep(0.5)
    if not gone:
        return error
    return peer_lost(gone, f"the step's collective failed: {first_line(error)}")


def exit(code: int = EXIT_CODE) -> NoReturn:  # noqa: A001 (the process exits: the name says it)
    """After `PeerLost`: end this process now, with `code`. JAX's exit-time shutdown
    would wait at a barrier for every process (the dead one never comes) and its
    coordination client would then abort the process; so stdio is flushed and the
    process exits without running finalizers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
