"""Two instances share a prompt's KV through a Valkey/Redis page store (kvpool.store).

    redis-server --port 6390 --save '' --appendonly no &      # or any reachable server
    python examples/shared_prefix.py --store redis://127.0.0.1:6390
    python examples/shared_prefix.py --store redis://127.0.0.1:6390 --dtype nvfp4

Two processes, each with its own pool, allocator and radix cache (Llama-3.1-8B's geometry, a
small pool on the CPU):

1. `serve` serves a prompt: allocates its pages, writes K/V for every layer (random values
   standing in for a forward pass) through `pool.write`, inserts the prompt into its radix
   cache, and publishes the whole pages to the store (`PageStore.put_pages`: one gather per
   buffer, one pipeline of SETs). It saves the bytes it wrote (`PageLayout.read`) for step 2.
2. `match` gets the same prompt: its radix cache has nothing, so it looks the prompt up in the
   store (`get_prefix`: one MGET, stopping at the first miss), allocates pages in its own pool
   (other page ids: its pool is larger and some pages are taken), loads them
   (`PageStore.load`: one index_copy_ per buffer), inserts them into its radix cache, matches
   the prompt again, and compares the bytes it reads from its pool with what `serve` wrote.

The parent prints one line, `shared_prefix: matched=<tokens> from_store=<tokens>
bytes_equal=<true|false>`, and exits 0 only when the bytes are equal. With `--events ENDPOINT`
it also subscribes to vLLM-format KV events there and prints each as `event <type> <n_hashes>`
(both instances publish through kvpool.events, connecting to the parent's SUB socket).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SEED = 20260101  # the page-hash seed every instance (and the router) agrees on


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--store", required=True, help="page store URL: redis://host:port/db, "
                   "rediss://..., redis+cluster://host:port")  # fmt: skip
    p.add_argument("--events", default=None, help="ZMQ endpoint where the parent "
                   "binds a SUB socket and prints the instances' KV events "
                   "(tcp://127.0.0.1:PORT)")  # fmt: skip
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B", help="bundled model id or "
                   "config.json")  # fmt: skip
    p.add_argument("--dtype", default="fp8_e4m3", help="KV dtype of both pools")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--prompt-tokens", type=int, default=100, help="prompt length (the partial "
                   "last page is not shared)")  # fmt: skip
    p.add_argument("--role", choices=["serve", "match"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--bytes-file", default=None, help=argparse.SUPPRESS)
    return p


def build(args, num_tokens: int):
    import kvpool
    import torch

    torch.set_num_threads(1)  # small tensors: threads only contend (a 2-core machine is common)

    plan = kvpool.size_for(args.model, args.dtype, page_size=args.page_size,
                           num_tokens=num_tokens)  # fmt: skip
    pool = kvpool.KVPool(plan, device="cpu")
    n = plan.spec.num_layers
    pool.set_kv_scales([0.05] * n, [0.04] * n, source="example")  # as a checkpoint would
    allocator = kvpool.PageAllocator(plan.num_pages, plan.page_size)
    # every instance hashes pages with the same seed: the keys of the store and of the events
    cache = kvpool.RadixCache(allocator, kv_events=args.events is not None,
                              hash_seed=SEED if args.events is not None else None)  # fmt: skip
    return pool, allocator, cache


def prompt(args) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 128_000, args.prompt_tokens).astype(np.int32)


def store_for(args, pool):
    from kvpool.store import PageStore

    return PageStore(pool, args.store, seed=SEED, socket_timeout=5.0, socket_connect_timeout=2.0)


def start_events(args, cache):
    """A publisher of the cache's KV events on ``args.events`` (None without ``--events``).

    vLLM's convention: the publisher connects to a host address where the subscriber (here the
    parent process) binds.
    """
    if args.events is None:
        return None
    import time

    from kvpool.events import EventPublisher

    pub = EventPublisher(args.events, cache=cache)
    time.sleep(0.3)  # ZMQ's slow joiner: let the connection settle before the first batch
    return pub


def serve(args) -> int:
    import kvpool
    import torch

    pool, _allocator, cache = build(args, num_tokens=256)
    pub = start_events(args, cache)
    tokens = prompt(args)
    ps = pool.page_size
    pages = cache.alloc(-(-len(tokens) // ps))
    lens = np.array([len(tokens)], np.int32)  # the prompt's slots, as a scheduler would
    loc = torch.from_numpy(kvpool.extend_slots(pages[None], np.zeros(1, np.int32), lens, ps))
    g = torch.Generator().manual_seed(1)
    for layer in pool.layers:  # a forward pass would write these
        view = pool.layer(layer)
        k = torch.randn(len(loc), view.num_kv_heads, view.head_dim, generator=g).bfloat16()
        v = torch.randn(len(loc), view.num_kv_heads, view.v_head_dim, generator=g).bfloat16()
        pool.write(layer, loc, k, v)
    cache.insert(tokens, pages)
    if pub is not None:
        pub.publish()  # the BlockStored of the prompt's pages
        pub.close()
    store = store_for(args, pool)
    n = store.put_pages(tokens, pages)
    whole = pages[: len(tokens) // ps]
    np.save(args.bytes_file, store.layout.read(whole).numpy())
    print(f"serve: wrote {len(tokens)} tokens, published {n} pages ({n * store.value_bytes} "
          f"bytes) under {store.fingerprint}", file=sys.stderr)  # fmt: skip
    return 0 if n == len(whole) else 1


def match(args) -> int:
    import torch

    pool, allocator, cache = build(args, num_tokens=512)
    pub = start_events(args, cache)
    taken = cache.alloc(5)  # another request's pages: the prompt gets other ids than in `serve`
    tokens = prompt(args)
    ps = pool.page_size
    cached, _node, matched = cache.match_prefix(tokens)
    store = store_for(args, pool)
    found = store.get_prefix(tokens, start_page=matched // ps)
    pages = cache.alloc(found.num_pages)
    store.load(found, pages)
    cache.insert(tokens[: matched + found.num_tokens(ps)], (cached, pages))
    allocator.free(pages)  # the cache keeps its own reference
    allocator.free(taken)
    cached, _node, matched = cache.match_prefix(tokens)
    if pub is not None:
        pub.publish()  # the pages loaded from the store, now cached here too
        pub.close()
    written = torch.from_numpy(np.load(args.bytes_file))
    mine = store.layout.read(cached)
    equal = found.num_pages > 0 and tuple(mine.shape) == tuple(written.shape) and bool(
        torch.equal(mine, written)
    )
    print(f"shared_prefix: matched={matched} from_store={found.num_tokens(ps)} "
          f"bytes_equal={'true' if equal else 'false'}")  # fmt: skip
    return 0 if equal else 1


def subscribe(endpoint: str, out: list[str], stop: threading.Event) -> threading.Thread:
    """Collect ``event <type> <n_hashes>`` lines from vLLM-format KV event batches.

    Frames: topic, 8-byte big-endian sequence number, msgpack ``[timestamp, [events...],
    data_parallel_rank]``; each event an array whose first item is its type name
    (``BlockStored``: block hashes second; ``BlockRemoved``: hashes second).
    """
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.bind(endpoint)  # (the instances' publishers connect, as vLLM's do)

    def run():
        while not stop.is_set():
            if not sock.poll(50):
                continue
            frames = sock.recv_multipart()
            _ts, events, _rank = msgpack.unpackb(frames[-1])[:3]
            for e in events:
                kind = e[0]
                n = len(e[1]) if kind in ("BlockStored", "BlockRemoved") else 0
                out.append(f"event {kind} {n}")
        sock.close(0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.role == "serve":
        return serve(args)
    if args.role == "match":
        return match(args)
    events: list[str] = []
    stop = threading.Event()
    listener = None
    if args.events is not None:
        listener = subscribe(args.events, events, stop)
    with tempfile.TemporaryDirectory() as tmp:
        common = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:]),
                  "--bytes-file", str(Path(tmp) / "written.npy")]  # fmt: skip
        first = subprocess.run([*common, "--role", "serve"])
        if first.returncode != 0:
            print("shared_prefix: matched=0 from_store=0 bytes_equal=false")
            return 1
        second = subprocess.run([*common, "--role", "match"], capture_output=True, text=True)
        sys.stderr.write(second.stderr)
    if listener is not None:
        time.sleep(0.2)  # the last batch in flight
        stop.set()
        listener.join()
        for line in events:
            print(line)
    lines = [ln for ln in second.stdout.splitlines() if ln.startswith("shared_prefix:")]
    print(lines[-1] if lines else "shared_prefix: matched=0 from_store=0 bytes_equal=false")
    return second.returncode if lines else 1


if __name__ == "__main__":
    sys.exit(main())
