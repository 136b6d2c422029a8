"""Two processes, one model (`ftjax.distributed`): started on localhost with
`jax.distributed` (gloo collectives), each process's device owns half of the experts;
they generate the single-process tokens; a process that dies makes the other fail with
`PeerLost` naming it, within the timeout, and exit cleanly; a process whose peer never
joins gets `DistributedError` naming the coordinator and the timeout; when process 0
(and the coordination service with it) dies, the others say so and exit. The server
over several processes: `test_serve_processes.py`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ftjax
from ftjax import distributed

HERE = Path(__file__).parent
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
ENV.pop("XLA_FLAGS", None)  # one CPU device per process
TIMEOUT_S = 10  # join and heartbeat: a dead peer is named this long after it dies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int, process_id: int, out: Path, *extra: str, timeout_s: int = TIMEOUT_S) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "distributed_check.py"), f"127.0.0.1:{port}", str(process_id),
                             str(out), "--timeout-s", str(timeout_s), *extra], env=ENV, cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_generate_the_single_process_tokens_and_a_dead_peer_is_named(tmp_path):
    port = free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [start(port, i, outs[i], "--die-after-first") for i in range(2)]
    logs = [p.communicate(timeout=600) for p in procs]
    assert procs[1].returncode == 9, logs[1][1][-3000:]  # died abruptly, as told
    assert procs[0].returncode == 3, logs[0][1][-3000:]  # the survivor's own, clean exit
    assert "Check failure" not in logs[0][1]  # no abort
    results = [json.loads(o.read_text()) for o in outs]
    want = ftjax.load(policy="lru", numerics="exact", cache_slots=8, bandwidth=(1.0, 1.0)).generate(
        [11, 275, 198, 42, 7, 300, 12, 95, 61, 8], 12)
    assert results[0]["tokens"] == results[1]["tokens"] == want
    assert results[0]["process_count"] == 2 and len(results[0]["devices"]) == 2
    assert [d["experts_owned"] for d in results[0]["devices"]] == [8, 8]
    assert [r["experts_read"] for r in results] == [list(range(0, 16, 2)), list(range(1, 16, 2))]  # its own only
    assert results[0]["second"].startswith("PeerLost: process 0 of 2: process 1 is gone")
    assert results[0]["second_s"] < TIMEOUT_S + 5


def test_when_process_0_dies_the_others_say_so_and_exit(tmp_path):
    port = free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [start(port, i, outs[i], "--die-after-first", "--dying", "0") for i in range(2)]
    logs = [p.communicate(timeout=600) for p in procs]
    assert procs[0].returncode == 9, logs[0][1][-3000:]
    assert procs[1].returncode == 3, logs[1][1][-3000:]
    assert "error: process 1 of 2: aborted by its coordination client, which lost the service in process 0" \
        in logs[1][1]


def test_a_peer_that_never_joins_is_a_clear_error_within_the_timeout(tmp_path):
    t0, timeout_s = time.monotonic(), 5
    proc = start(free_port(), 0, tmp_path / "p0.json", timeout_s=timeout_s)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Check failure" not in err
    assert "DistributedError: process 0 of 2: the processes did not all join 127.0.0.1" in err
    assert f"within {timeout_s} s" in err and time.monotonic() - t0 < 3 * timeout_s + 30


@pytest.mark.parametrize("args, match", [(("127.0.0.1:1", 0, 0), "num_processes"), (("127.0.0.1:1", 2, 2), "process_id"),
                                         (("localhost", 2, 0), "host:port"), (("127.0.0.1:1", 2, 0, 0), "timeout_s")])
def test_connect_checks_its_arguments_first(args, match):
    with pytest.raises(ValueError, match=match):
        distributed.connect(*args)



def test_exit_on_abort_names_the_reason_and_exits_with_its_code():
    """What a process other than 0 does when its coordination client aborts it (process 0
    gone): the message, then the distributed exit status (end to end under -m slow)."""
    code = ("from ftjax import _host_kernels, distributed; import os; "
            "_host_kernels.exit_on_abort('error: process 1 of 2: process 0 is gone', distributed.EXIT_CODE); "
            "os.abort()")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == distributed.EXIT_CODE == 3
    assert proc.stderr.endswith("error: process 1 of 2: process 0 is gone\n")
