"""Page-store throughput and latency through a local redis-server (kvpool.store).

    python benches/store/bench_store.py [--reps 5] [--out benches/store/results/store_cpu.json]

A Llama-3.1-8B pool (32 layers, 8 KV heads, head_dim 128; every layer's K and V, scales
included) at page 16, for fp8_e4m3 (1 MiB a page) and nvfp4 (576 KiB a page), on the CPU. For
each dtype and each repetition, with a fresh 4k-token prompt (256 pages):

- put: ``PageStore.put_pages`` of the 256 pages (one gather per buffer, encoding with XXH3-128
  checksums, one pipeline of SETs);
- get: ``PageStore.get_prefix`` of the same prompt (one MGET, every value checked) — the
  latency of a 4k-token prefix lookup — and ``PageStore.load`` of the result into other page
  ids (one index_copy_ per buffer);
- mget: the bare ``MGET`` of the same keys through the same client (what the checks cost on top);
- miss: ``get_prefix`` of a prompt that is not stored (the first key is absent);
- run16: put and get of a 16-page (256-token) run.

Rates count value bytes (pages plus their ~600-byte header). Medians over the repetitions, with
min and max, after one warm-up repetition (the first touch of fresh memory is slow on a VM).
``redis`` parses replies with ``hiredis`` when it is importable (``parser`` in the results). Starts its own server (``--save '' --appendonly no``) on a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kvpool
from kvpool.store import PageStore

PS = 16
PROMPT = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server():
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("bench_store: redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", tempfile.gettempdir()],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            return proc, port, r
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("bench_store: redis-server did not start")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def bench_dtype(dtype: str, url: str, admin, reps: int) -> dict:
    pages_needed = 2 * (PROMPT // PS) + 1
    plan = kvpool.size_for("meta-llama/Llama-3.1-8B", dtype, page_size=PS,
                           num_tokens=pages_needed * PS)  # fmt: skip
    pool = kvpool.KVPool(plan, device="cpu")
    for t in pool.buffers.values():
        if t.numel() > 1:
            u = t.view(torch.uint8)
            u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8))
    store = PageStore(pool, url, seed=1, socket_timeout=60, socket_connect_timeout=5)
    n = PROMPT // PS
    src = np.arange(1, n + 1, dtype=np.int32)
    dst = np.arange(n + 1, 2 * n + 1, dtype=np.int32)
    vb = store.value_bytes
    res: dict[str, list[float]] = {k: [] for k in
                                   ("put", "get", "load", "mget", "miss", "put16", "get16")}  # fmt: skip
    rng = np.random.default_rng(0)
    for rep in range(reps + 1):  # rep 0 warms up (first touch of fresh memory), not counted
        if rep == 1:
            res = {k: [] for k in res}
        admin.flushall()
        tokens = rng.integers(0, 128_000, PROMPT).astype(np.int32)
        dt, written = timed(lambda: store.put_pages(tokens, src))  # noqa: B023
        assert written == n
        res["put"].append(dt)
        dt, found = timed(lambda: store.get_prefix(tokens))  # noqa: B023
        assert found.num_pages == n and found.stop == "end"
        res["get"].append(dt)
        dt, _ = timed(lambda: store.load(found, dst))  # noqa: B023
        res["load"].append(dt)
        assert torch.equal(store.layout.read(dst[:4]), store.layout.read(src[:4]))
        keys = [store.key(h) for h in store.hashes(tokens)]
        dt, vals = timed(lambda: store.client.mget(keys))  # noqa: B023
        assert all(v is not None for v in vals)
        res["mget"].append(dt)
        del vals, found
        other = rng.integers(0, 128_000, PROMPT).astype(np.int32)
        dt, miss = timed(lambda: store.get_prefix(other))  # noqa: B023
        assert miss.num_pages == 0
        res["miss"].append(dt)
        short = rng.integers(0, 128_000, 16 * PS).astype(np.int32)
        dt, _ = timed(lambda: store.put_pages(short, src[:16]))  # noqa: B023
        res["put16"].append(dt)
        dt, f16 = timed(lambda: store.get_prefix(short))  # noqa: B023
        assert f16.num_pages == 16
        res["get16"].append(dt)
    out = {
        "page_bytes": store.layout.page_bytes,
        "value_bytes": vb,
        "pages_per_lookup": n,
        "seconds": {k: summary(v) for k, v in res.items()},
    }
    for op, pages in (("put", n), ("get", n), ("mget", n), ("put16", 16), ("get16", 16)):
        med = statistics.median(res[op])
        out[op] = {"pages_per_s": pages / med, "MB_per_s": pages * vb / med / 1e6}
    out["load"] = {"pages_per_s": n / statistics.median(res["load"]),
                   "MB_per_s": n * store.layout.page_bytes / statistics.median(res["load"]) / 1e6}  # fmt: skip
    out["lookup_4k_tokens_ms"] = summary([1e3 * x for x in res["get"]])
    out["lookup_4k_tokens_plus_load_ms"] = summary(
        [1e3 * (g + lo) for g, lo in zip(res["get"], res["load"], strict=True)]
    )
    out["miss_lookup_ms"] = summary([1e3 * x for x in res["miss"]])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtypes", default="fp8_e4m3,nvfp4")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "store_cpu.json"))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    proc, port, admin = start_server()
    try:
        import redis

        url = f"redis://127.0.0.1:{port}/0"
        results = {
            "machine": "CPU VM 2 cores, shared with other builds",
            "loadavg_before": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "redis_py": redis.__version__,
            "redis_server": admin.info()["redis_version"],
            "parser": "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python",
            "torch_threads": args.threads,
            "reps": args.reps,
            "model": "meta-llama/Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128)",
            "page_size": PS,
            "prompt_tokens": PROMPT,
            "dtypes": {},
        }
        for dtype in args.dtypes.split(","):
            results["dtypes"][dtype] = bench_dtype(dtype, url, admin, args.reps)
            d = results["dtypes"][dtype]
            print(f"{dtype}: put {d['put']['pages_per_s']:.0f} pages/s "
                  f"{d['put']['MB_per_s']:.0f} MB/s, get {d['get']['pages_per_s']:.0f} pages/s "
                  f"{d['get']['MB_per_s']:.0f} MB/s, 4k lookup "
                  f"{d['lookup_4k_tokens_ms']['median']:.1f} ms (+load "
                  f"{d['lookup_4k_tokens_plus_load_ms']['median']:.1f} ms), bare mget "
                  f"{d['mget']['MB_per_s']:.0f} MB/s, miss "
                  f"{d['miss_lookup_ms']['median']:.2f} ms")  # fmt: skip
        results["loadavg_after"] = os.getloadavg()
    finally:
        proc.kill()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
