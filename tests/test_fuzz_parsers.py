"""Fuzz targets for the parsers of untrusted files (issue 18): config.json, GGUF header, scale JSON,
safetensors checkpoints.

Each target feeds mutated inputs (seeds in ``tests/fuzz_seeds/``, mutated byte-wise or
structurally by hypothesis) to the parser and accepts only a result or the documented error
(ValueError subclasses: ``ModelConfigError``, ``KvDtypeError``, the scale loaders' ValueError).
Anything else (OverflowError, RecursionError, KeyError, a hang, a crash) is a bug.

Short run in the normal suite (``KVPOOL_FUZZ_EXAMPLES``, default 150 inputs per target, seconds).
Long run, e.g. 100,000 inputs per target::

    KVPOOL_FUZZ_EXAMPLES=100000 python -m pytest -q -p no:randomly tests/test_fuzz_parsers.py

Hypothesis keeps failing inputs in its example database (``.hypothesis/``) and replays them first.
"""

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvpool
from kvpool.gguf import read_header
from kvpool.scales import read_checkpoint_scales, read_json_scales

SEEDS = Path(__file__).parent / "fuzz_seeds"
EXAMPLES = int(os.environ.get("KVPOOL_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """``data`` with each (position, kind, byte) edit applied: 0 overwrite, 1 insert, 2 delete,
    3 truncate there."""
    b = bytearray(data)
    for pos, kind, val in edits:
        if not b:
            break
        i = pos % len(b)
        if kind == 0:
            b[i] = val
        elif kind == 1:
            b.insert(i, val)
        elif kind == 2:
            del b[i]
        else:
            del b[i:]
    return bytes(b)


EDITS = st.lists(
    st.tuples(st.integers(0, 1 << 16), st.integers(0, 3), st.integers(0, 255)), max_size=8
)
# Values that break parsers: huge, negative, odd types, NaN, deep nesting.
JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**200]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["full", "sliding_attention", "linear_attention", "bfloat16", "fp8"]),
)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=24), inner, max_size=4)
    ),
    max_leaves=12,
)


# --- config.json ------------------------------------------------------------------------------

CONFIG = json.loads((SEEDS / "config.json").read_text())
CONFIG_KEYS = sorted(CONFIG) + [
    "head_dim", "sliding_window", "layer_types", "kv_lora_rank", "qk_rope_head_dim",
    "text_config", "vision_config", "linear_key_head_dim", "linear_num_value_heads",
    "use_sliding_window", "max_window_layers", "quantization_config",
]  # fmt: skip


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON, max_size=4), drop=st.sets(st.sampled_from(sorted(CONFIG))))
@example(changes={}, drop=set())
def test_fuzz_config_from_dict(changes, drop):
    d = {k: v for k, v in CONFIG.items() if k not in drop}
    d.update(changes)
    try:
        spec = kvpool.ModelSpec.from_dict(d)
    except ValueError:
        return
    assert spec.num_layers if hasattr(spec, "num_layers") else spec.layer_kinds


@FUZZ
@given(edits=EDITS)
def test_fuzz_config_bytes(tmp_path, edits):
    text = mutate((SEEDS / "config.json").read_bytes(), edits)
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_bytes(text)
    try:
        kvpool.ModelSpec.from_pretrained(str(d))
    except ValueError:
        pass


# --- GGUF header ------------------------------------------------------------------------------


@FUZZ
@given(
    seed=st.sampled_from(["tiny.gguf", "arrays.gguf"]),
    edits=EDITS,
    tail=st.binary(max_size=64),
    arrays=st.booleans(),
)
@example(seed="arrays.gguf", edits=[], tail=b"", arrays=True)
def test_fuzz_gguf_header(tmp_path, seed, edits, tail, arrays):
    f = tmp_path / "x.gguf"
    f.write_bytes(mutate((SEEDS / seed).read_bytes(), edits) + tail)
    try:
        read_header(f, arrays=arrays)
    except kvpool.ModelConfigError:
        pass


# --- scale JSON -------------------------------------------------------------------------------

SCALES = json.loads((SEEDS / "scales.json").read_text())


@FUZZ
@given(rank=JSON, layers=JSON, dtype=JSON, tp_rank=st.one_of(st.integers(-2, 3), JSON_LEAF))
def test_fuzz_scale_json_structure(rank, layers, dtype, tp_rank):
    doc = json.loads(json.dumps(SCALES))
    kv = doc["kv_cache"]
    if isinstance(dtype, str):
        kv["dtype"] = dtype
    kv["scaling_factor"][str(rank)[:8]] = layers
    try:
        _, k, v = read_json_scales(doc, tp_rank)
    except ValueError:
        return
    assert all(x > 0 and math.isfinite(x) for x in [*k.values(), *v.values()])


@FUZZ
@given(edits=EDITS)
def test_fuzz_scale_json_bytes(tmp_path, edits):
    f = tmp_path / "s.json"
    f.write_bytes(mutate((SEEDS / "scales.json").read_bytes(), edits))
    try:
        read_json_scales(f)
    except ValueError:
        pass


# --- safetensors ------------------------------------------------------------------------------


@FUZZ
@given(edits=EDITS)
@example(edits=[])
def test_fuzz_safetensors(tmp_path, edits):
    pytest.importorskip("safetensors")
    f = tmp_path / "m.safetensors"
    f.write_bytes(mutate((SEEDS / "scales.safetensors").read_bytes(), edits))
    try:
        k, v = read_checkpoint_scales(f)
    except ValueError:
        return
    assert all(x > 0 and math.isfinite(x) for x in [*k.values(), *v.values()])
