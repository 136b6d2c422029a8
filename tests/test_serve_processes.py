"""`ftjax serve` over two processes (`engine.replica`): process 0 serves, process 1 runs
its steps; requests one at a time and concurrent (stop strings, forced tool calls,
state-cache hits, a client that disconnects) get the same answers, one process's; a follower that dies ends the
request in flight with an error naming it and the server exits; a follower started
with other settings is refused, by name, before any step; a leader and a follower
scheduler replay every kind of decision to the same state."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import serving

HERE = Path(__file__).parent
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
ENV.pop("XLA_FLAGS", None)  # one CPU device per process
TIMEOUT_S = 10  # join and heartbeat: a dead peer is named this long after it dies


SERVE = ("--policy", "lru", "--cache-slots", "8", "--bandwidth", "1", "1", "--numerics", "exact", "--max-batch", "4")


def start_serving(coordinator: int, http_port: int, process_id: int, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ftjax.cli", "serve", "--port", str(http_port + process_id),
                             "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id",
                             str(process_id), "--join-timeout-s", str(TIMEOUT_S), *SERVE, *extra], env=ENV,
                            cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def serving_pair(tmp_path: Path) -> tuple[list[subprocess.Popen], list[Path], int]:
    """Both processes of a server, once process 0 answers /health -> (processes, logs, its port)."""
    coordinator, http_port = serving.free_port(), serving.free_port()
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [start_serving(coordinator, http_port, i, logs[i]) for i in range(2)]
    deadline = time.time() + 300
    while not serving.healthy(http_port):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError("the server did not come up:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
        time.sleep(0.3)
    return procs, logs, http_port


def post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps({"model": "ftjax-default", **body}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read().decode())
    conn.close()
    assert r.status == 200, out
    return out


def stream(port: int, body: dict):
    """-> (connection, response) of a streaming chat, its first chunk read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "ftjax-default", **body, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data:")
    return conn, r


ASKS = ["Who was Mr. Darcy?", "Tell me about Emma.", "To be, or not to be", "Write a function that adds two numbers."]
ADD = {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}


def answers(port: int, concurrent: bool = True) -> list:
    """Greedy chats, one with a stop string, one with a forced tool call; concurrent, or one
    after another."""
    bodies = [{"messages": [{"role": "user", "content": a}], "max_tokens": 16, "temperature": 0} for a in ASKS]
    bodies[1]["stop"] = ["."]
    bodies[3].update(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=24)
    got = [None] * len(bodies)

    def ask(i):
        m = post(port, "/v1/chat/completions", bodies[i])["choices"][0]
        got[i] = (m["message"]["content"], [c["function"]["name"] for c in m["message"].get("tool_calls") or []],
                  m["finish_reason"])
    if not concurrent:
        for i in range(len(bodies)):
            ask(i)
        return got
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_serve_over_two_processes_answers_as_one_and_ends_when_a_follower_dies(tmp_path):
    import ftjax

    model = ftjax.load(policy="lru", numerics="exact", cache_slots=8, bandwidth=(1.0, 1.0))
    first = model.tokenizer.decode(model.generate(model.tokenizer.encode_chat(
        [{"role": "user", "content": ASKS[0]}]), 16)).strip()
    procs, logs, http_port = serving_pair(tmp_path)
    try:
        want = answers(http_port, concurrent=False)  # one at a time, then together: the batch changes nothing
        assert want[0][0] == first  # and the first is what one process generates
        assert answers(http_port) == want
        again = post(http_port, "/v1/chat/completions", {"messages": [{"role": "user", "content": ASKS[0]}],
                                                          "max_tokens": 16, "temperature": 0})
        assert again["choices"][0]["message"]["content"] == want[0][0]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the state cache, on both processes

        long = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 1500}
        conn, r = stream(http_port, long)  # a client that goes away: the job ends on both processes
        r.close()
        conn.sock.close()
        after = post(http_port, "/v1/chat/completions", {"messages": [{"role": "user", "content": ASKS[2]}],
                                                          "max_tokens": 16, "temperature": 0})
        assert after["choices"][0]["message"]["content"] == want[2][0]  # still in step

        conn, r = stream(http_port, long)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rest = r.read().decode()
        assert "process 1 is gone" in rest, rest[-2000:]  # the request in flight ends with the reason
        assert procs[0].wait(TIMEOUT_S + 30) == 3  # the leader's own, clean exit
        assert time.monotonic() - t0 < TIMEOUT_S + 30
        err = logs[0].read_text()
        assert "error: process 0 of 2: process 1 is gone" in err and "Check failure" not in err
    finally:
        for p in procs:
            p.kill()


def test_a_follower_with_other_settings_is_refused_by_name(tmp_path):
    coordinator, http_port = serving.free_port(), serving.free_port()
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [start_serving(coordinator, http_port, 0, logs[0]),
             start_serving(coordinator, http_port, 1, logs[1], "--max-batch", "2")]
    try:
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    err = [log.read_text() for log in logs]
    assert codes == [3, 3], err
    assert "process 1 refused process 0's scheduler: max_batch: process 0 has 4, process 1 has 2" in err[0]
    assert "the scheduler settings differ from process 0's (max_batch" in err[1]


def test_a_follower_scheduler_replays_every_decision_of_the_leader(tmp_path):
    """Leader and follower in one process (`replica_check.py`): the same tokens (the
    follower checks each), the same outcomes and counters, no mirror job left behind,
    and a token the follower did not produce is a divergence, named."""
    out = tmp_path / "replica.json"
    proc = subprocess.run([sys.executable, str(HERE / "replica_check.py"), str(serving.free_port()), str(out)], env=ENV,
                          cwd=HERE, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["outcomes"] == {"plain": "length", "stop": "stop", "forced": "length", "cancelled": "cancelled",
                             "raises": "error: RuntimeError: the client's parser broke", "sampled": "length",
                             "deadline": "timeout", "banned": "length", "after idle": "length"}
    assert r["tokens"]["forced"][2:5] == [7, 8, 9] and len(r["tokens"]["stop"]) == 5
    assert not {11, 12} & set(r["tokens"]["banned"])
    assert r["leader"] == r["follower"]
    assert r["leader"]["idle"] == {"waiting": 0, "admitted": 2, "done": 1, "preempted": 1, "dropped": 1,
                                   "tokens": r["leader"]["idle"]["tokens"]}
    assert r["follower_jobs_alive"] == 0 and r["cache"][0] == r["cache"][1]
    assert r["diverged"] == "process 0: job 99 produced token 6 where process 0's job 99 produced 5"


def test_stopping_process_0_stops_the_others_cleanly(tmp_path):
    """SIGTERM to process 0: it drains, tells the followers to stop and waits for them, so
    every process ends cleanly (a follower still connected when process 0 ends would be
    aborted by its coordination client)."""
    procs, logs, http_port = serving_pair(tmp_path)
    try:
        post(http_port, "/v1/chat/completions", {"messages": [{"role": "user", "content": ASKS[0]}], "max_tokens": 4})
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(120) for p in procs]  # uvicorn re-raises the signal it handled: -15 is a clean stop
        assert codes[0] in (0, -signal.SIGTERM) and codes[1] == 0, [log.read_text()[-2000:] for log in logs]
        assert "error" not in logs[1].read_text()
    finally:
        for p in procs:
            p.kill()
