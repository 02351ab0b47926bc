"""examples/shared_prefix.py end to end against a real redis-server (two processes, two pools)."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("redis")

from llama_fixtures import EXAMPLES  # noqa: E402
from redis_fixtures import serve  # noqa: E402

redis_server = pytest.fixture(scope="session")(serve)
LINE = re.compile(r"shared_prefix: matched=(\d+) from_store=(\d+) bytes_equal=(true|false)")


@pytest.mark.parametrize("dtype, extra", [("fp8_e4m3", []),
                                          ("nvfp4", ["--events", "tcp://127.0.0.1:1"])])
def test_second_instance_loads_the_first_ones_bytes(redis_server, dtype, extra):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "shared_prefix.py"), "--store", redis_server.url,
         "--dtype", dtype, "--prompt-tokens", "70", *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    if extra:  # --events: event lines (once kvpool.events publishes), then the result
        assert all(ln.startswith("event ") for ln in lines[:-1]), out.stdout
        assert "kvpool.events" in out.stderr
    else:
        assert len(lines) == 1, out.stdout
    assert LINE.fullmatch(lines[-1])
    assert lines[-1] == "shared_prefix: matched=64 from_store=64 bytes_equal=true"
