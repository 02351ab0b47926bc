"""Issue 18 point 5: work proportional to the input at 65,536 layers (what the parser accepts).

`Plan.request_bytes` took 74 s at 65,536 layers (8.1 s at 32,768: quadratic), with the GIL held.
Checked: building the geometry, the plan, `request_bytes` and `buffers` at 65,536 layers, each
under `BOUND_S`, in a child with a timeout so that a quadratic regression fails in seconds instead
of minutes. The bound is generous on purpose, a wall-clock bound on a shared machine: linear work
takes 0.02-0.2 s per step there (0.016 s for `request_bytes`) and 1.2 s for `buffers` (131,072
rows of Python tuples) on a loaded 2-core machine, so 10 s is 8x above the slowest linear step
(the old 1 s bound on `buffers` failed under load), and the quadratic `request_bytes` took 74 s,
7x above it. The core exposes no operation count to assert on instead.
Cause (for the fix, in rust/src/sizing.rs / layout.rs): `Plan::request_bytes` calls
`Layout::layer_bytes_per_token(i)` for every layer, and that scans every buffer for `layer ==
Some(i)`: O(layers x buffers). Summing each buffer's `row_bytes` into its layer once is linear.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvpool
import pytest

PKG_ROOT = str(Path(kvpool.__file__).resolve().parent.parent)
LAYERS = 65_536
# Seconds per step (see the module text: 8x over linear work under load, 7x under the regression).
BOUND_S = 10.0
# The child's whole run: the import and the four steps, each under BOUND_S.
TIMEOUT_S = 120

CODE = textwrap.dedent(
    f"""
    import json, time
    import kvpool, kvpool._core as core
    t = {{}}
    t0 = time.perf_counter()
    g = core.ModelGeometry(layer_kinds=["full", "sliding"] * ({LAYERS} // 2), num_attention_heads=8,
                           num_kv_heads=8, head_dim=64, v_head_dim=64, sliding_window=4096)
    t["geometry"] = time.perf_counter() - t0; t0 = time.perf_counter()
    p = core.plan(g, "bf16", num_tokens=1024, page_size=16)
    t["plan"] = time.perf_counter() - t0; t0 = time.perf_counter()
    b = p.request_bytes(100_000)
    t["request_bytes"] = time.perf_counter() - t0; t0 = time.perf_counter()
    rows = p.buffers
    t["buffers"] = time.perf_counter() - t0
    print(json.dumps(t))
    """
)


def test_request_bytes_at_65536_layers_is_linear():
    env = dict(os.environ, PYTHONPATH=PKG_ROOT)
    try:
        r = subprocess.run(
            [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"65,536 layers took over {TIMEOUT_S} s (quadratic)")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)
    assert set(t) == {"geometry", "plan", "request_bytes", "buffers"}, t
    slow = {step: dt for step, dt in t.items() if dt >= BOUND_S}
    assert not slow, f"steps over {BOUND_S} s at {LAYERS:,} layers (quadratic?): {slow}; all: {t}"
