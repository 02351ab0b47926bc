"""examples/shared_prefix.py end to end against a real redis-server (two processes, two pools)."""

import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("redis")

from llama_fixtures import EXAMPLES  # noqa: E402
from redis_fixtures import serve  # noqa: E402

redis_server = pytest.fixture(scope="session")(serve)
LINE = re.compile(r"shared_prefix: matched=(\d+) from_store=(\d+) bytes_equal=(true|false)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dtype, events", [("fp8_e4m3", False), ("nvfp4", True)])
def test_second_instance_loads_the_first_ones_bytes(redis_server, dtype, events):
    extra = ["--events", f"tcp://127.0.0.1:{_free_port()}"] if events else []
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "shared_prefix.py"), "--store", redis_server.url,
         "--dtype", dtype, "--prompt-tokens", "70", *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    if extra:  # --events: each instance's BlockStored of the prompt's 4 whole pages (70 tokens)
        assert lines[:-1] == ["event BlockStored 4", "event BlockStored 4"], out.stdout
    else:
        assert len(lines) == 1, out.stdout
    assert LINE.fullmatch(lines[-1])
    assert lines[-1] == "shared_prefix: matched=64 from_store=64 bytes_equal=true"
