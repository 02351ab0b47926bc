"""Issue 18 point 5: work proportional to the input at 65,536 layers (what the parser accepts).

`Plan.request_bytes` took 74 s at 65,536 layers (8.1 s at 32,768: quadratic), with the GIL held.
Checked: building the geometry, the plan, `request_bytes` and `buffers` at 65,536 full-attention
layers, each under a time bound with a wide margin over linear work (a few ms), in a child with a
timeout so that a quadratic regression fails in seconds instead of minutes.
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

import pytest

import kvpool

PKG_ROOT = str(Path(kvpool.__file__).resolve().parent.parent)
LAYERS = 65_536

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
        r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=8, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("65,536 layers took over 8 s (quadratic)")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)
    # linear, not quadratic (74 s before the layer-groups layout); the issue's < 10 ms target is
    # met on an idle 2-core machine (5.4 ms), but a unit test does not time a shared machine
    assert t["request_bytes"] < 0.5, t
    assert t["buffers"] < 1.0, t  # 131,072 rows of Python tuples: linear, well under a second
    assert t["geometry"] < 0.5 and t["plan"] < 1.0, t
