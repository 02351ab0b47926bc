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
    """A fresh server (a new free port; three tries, as another process may take the port)."""
    for attempt in range(3):
        try:
            return _start(**options)
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _free_pair() -> int:
    """A free port ``p`` below 55536 whose cluster bus port ``p + 10000`` is free too."""
    while True:
        p = free_port()
        if p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p


def _start(**options: str) -> Server:
    if REDIS_SERVER is None:
        pytest.skip("redis-server (or valkey-server) is not installed: "
                    "apt-get install redis-server")
    port = _free_pair() if options.get("cluster_enabled") == "yes" else free_port()
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


def start_cluster(n: int = 3) -> list[Server]:
    """``n`` masters in cluster mode on 127.0.0.1, slots split by ``redis-cli --cluster create``."""
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed: apt-get install redis-server")
    tmp = tempfile.mkdtemp(prefix="kvpool-cluster-")
    nodes = []
    try:
        for i in range(n):
            nodes.append(start_redis(cluster_enabled="yes", dir=tmp,
                                     cluster_config_file=f"nodes-{i}.conf"))  # fmt: skip
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 20
        while any(b"cluster_state:ok" not in s.client().execute_command("CLUSTER", "INFO")
                  for s in nodes):  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return nodes
    except BaseException:
        for s in nodes:
            s.stop()
        raise
