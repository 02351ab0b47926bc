"""A real ``redis-server`` on 127.0.0.1 for the page-store tests (never a mock).

``serve()`` yields one server without persistence (``--save '' --appendonly no``) and kills it
at the end: a test module makes it its session fixture with
``redis_server = pytest.fixture(scope="session")(serve)``. ``start_redis(**options)`` starts
another with extra options (e.g. ``maxmemory``), for tests that change the server's behaviour.
Tests skip with a clear reason only when the ``redis-server`` binary is missing (CI installs it:
``.ci/run``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import pytest

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_redis(**options: str) -> Server:
    if REDIS_SERVER is None:
        pytest.skip("redis-server (or valkey-server) is not installed: "
                    "apt-get install redis-server")
    port = free_port()
    args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", tempfile.gettempdir()]
    for k, v in options.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = Server(proc, port)
    deadline = time.monotonic() + 10
    while True:
        try:
            if server.client().ping():
                return server
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"redis-server did not start: {' '.join(args)}") from None
            time.sleep(0.05)


def serve():
    server = start_redis()
    yield server
    server.stop()
