"""Test helper: `ftjax serve` in a subprocess on a free port (the real server, as
clients meet it)."""

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
import http.client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


@contextmanager
def server(*args: str, timeout_s: float = 120, env: dict | None = None):
    """Run `ftjax serve --port P *args` until the block ends -> P."""
    port = free_port()
    env = {**(env or os.environ), "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ftjax.cli", "serve", "--port", str(port), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).parents[1])
    try:
        deadline = time.time() + timeout_s
        while not healthy(port):
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + proc.stdout.read())
            if time.time() > deadline:
                raise RuntimeError("server did not come up")
            time.sleep(0.3)
        yield port
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down, the engine closes (and persists its state cache)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def get_json(port: int, path: str):
    return request(port, "GET", path)[1]


def request(port: int, method: str, path: str, body=None, headers: dict | None = None):
    """-> (status, decoded JSON or text). `body`: bytes as they are, anything else as JSON."""
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # a request that never ends fails here
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(text)
    except json.JSONDecodeError:
        return r.status, text
