"""KV scales: checkpoints (KVB-08), JSON files (KVB-10), calibration, and the missing-scales
warning (KVB-12). Every source ends in pool.set_kv_scales, which the write and read paths read."""

from __future__ import annotations

import json
import logging
import math
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import kvpool  # noqa: E402
from kvpool import scales  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.scales import KVScaleWarning, MissingKVScalesWarning  # noqa: E402


def make_pool(dtype="fp8_e4m3", layers=5, heads=2, head_dim=16, device="cpu"):
    cfg = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads * 2,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "hidden_size": 64,
        "vocab_size": 10,
    }
    plan = kvpool.size_for(ModelSpec.from_dict(cfg), dtype, num_tokens=16, page_size=4)
    return kvpool.KVPool(plan, device=device)


def pool_scales(pool):
    n = pool.plan.spec.num_layers
    return [(float(pool.layer(i).k_scale), float(pool.layer(i).v_scale)) for i in range(n)]


KVB08 = {
    "model.layers.0.self_attn.qkv_proj.k_scale": 0.05,
    "model.layers.0.self_attn.qkv_proj.v_scale": 0.08,
    "model.layers.1.self_attn.k_proj.k_scale": 0.06,
    "model.layers.1.self_attn.v_proj.v_scale": 0.09,
    "model.layers.2.self_attn.kv_scale": 0.07,
    "model.layers.3.self_attn.k_scale": 0.04,
    "model.layers.3.self_attn.v_scale": 0.03,
    "model.layers.4.self_attn.attn.k_scale": 0.02,
    "model.layers.4.self_attn.attn.v_scale": 0.01,
    "model.layers.0.self_attn.k_proj.weight_scale": 0.5,
    "model.layers.0.self_attn.k_proj.input_scale": 0.7,
}
KVB08_EXPECTED = [(0.05, 0.08), (0.06, 0.09), (0.07, 0.07), (0.04, 0.03), (0.02, 0.01)]


def save_checkpoint(tmp_path, tensors, shards=2, index=True):
    """An HF-style sharded checkpoint: weights interleaved with scales over ``shards`` files."""
    names = sorted(tensors)
    wm = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {
            n: torch.as_tensor(tensors[n], dtype=torch.float32).reshape(
                -1 if isinstance(tensors[n], list) else ()
            )
            for n in names[s::shards]
        }
        part[f"model.layers.{s}.mlp.weight"] = torch.zeros(4, 4)
        safetensors_torch.save_file(part, str(tmp_path / fname))
        wm.update({n: fname for n in part})
    if index:
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": wm})
        )
    return tmp_path


@pytest.mark.parametrize("index", [True, False])
def test_kvb08_every_name_maps_to_its_layer(tmp_path, index):
    save_checkpoint(tmp_path, KVB08, index=index)
    k, v = scales.read_checkpoint_scales(tmp_path)
    assert [(k[i], v[i]) for i in range(5)] == [
        tuple(map(lambda x: pytest.approx(x, rel=1e-7), p)) for p in KVB08_EXPECTED
    ]
    pool = make_pool()
    scales.load_checkpoint_scales(pool, tmp_path)
    got = pool_scales(pool)
    for (gk, gv), (ek, ev) in zip(got, KVB08_EXPECTED, strict=True):
        assert gk == pytest.approx(ek, rel=1e-7) and gv == pytest.approx(ev, rel=1e-7)
    assert all(s != (1.0, 1.0) for s in got)
    assert pool.scales_source.startswith("checkpoint:")


def test_kvb08_single_file_and_index_path(tmp_path):
    save_checkpoint(tmp_path, KVB08, shards=1, index=True)
    k, _ = scales.read_checkpoint_scales(tmp_path / "model.safetensors.index.json")
    assert sorted(k) == [0, 1, 2, 3, 4]
    k2, _ = scales.read_checkpoint_scales(tmp_path / "model-00001-of-00001.safetensors")
    assert k2 == k


def test_kvb08_missing_layer_names_it(tmp_path):
    save_checkpoint(tmp_path, KVB08)
    pool = make_pool(layers=6)
    with pytest.raises(ValueError, match=r"layer\(s\) 5 "):
        scales.load_checkpoint_scales(pool, tmp_path)
    assert pool.scales_source is None  # nothing changed


def test_kvb08_per_head_uses_max_with_warning(tmp_path):
    t = dict(KVB08)
    t["model.layers.0.self_attn.qkv_proj.k_scale"] = [0.05, 0.20]
    save_checkpoint(tmp_path, t)
    pool = make_pool()
    with pytest.warns(KVScaleWarning, match="layer 0: .* 2 per-head values .* using the max 0.2"):
        scales.load_checkpoint_scales(pool, tmp_path)
    assert pool_scales(pool)[0][0] == pytest.approx(0.20)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_bad_checkpoint_values_raise_naming_the_layer(tmp_path, bad):
    t = dict(KVB08)
    t["model.layers.3.self_attn.v_scale"] = bad
    save_checkpoint(tmp_path, t)
    with pytest.raises(ValueError, match=r"layer 3: `model.layers.3.self_attn.v_scale`"):
        scales.read_checkpoint_scales(tmp_path)


def test_only_one_of_k_v_is_used_for_both_and_conflicts_raise(tmp_path, caplog):
    save_checkpoint(
        tmp_path,
        {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.1.self_attn.v_scale": 0.25},
    )
    with caplog.at_level(logging.INFO, logger="kvpool.scales"):
        k, v = scales.read_checkpoint_scales(tmp_path)
    assert (k[0], v[0], k[1], v[1]) == (0.5, 0.5, 0.25, 0.25)
    assert "only k_scale" in caplog.text
    d = tmp_path / "conflict"
    d.mkdir()
    save_checkpoint(
        d, {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.k_proj.k_scale": 0.6}
    )
    with pytest.raises(ValueError, match="layer 0: conflicting scales"):
        scales.read_checkpoint_scales(d)


def test_checkpoint_without_scales_or_files_raises(tmp_path):
    save_checkpoint(tmp_path, {"model.layers.0.self_attn.k_proj.weight_scale": 0.5})
    with pytest.raises(ValueError, match="no KV scales"):
        scales.load_checkpoint_scales(make_pool(), tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        scales.read_checkpoint_scales(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model.safetensors.index.json"):
        scales.read_checkpoint_scales(tmp_path / "empty")


KVB10 = {
    "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 2.0, "1": [2.0, 4.0]}}}
}


def test_kvb10_json_scales_reach_write_and_read(tmp_path):
    path = tmp_path / "kv_scales.json"
    path.write_text(json.dumps(KVB10))
    pool = make_pool(layers=2, heads=1, head_dim=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file supplied the scales: no missing-scales warning
        scales.load_json_scales(pool, path, tp_rank=0)
        assert pool_scales(pool) == [(2.0, 2.0), (2.0, 4.0)]
        x = torch.full((1, 1, 16), 600.0)
        loc = torch.tensor([5])
        for layer in (0, 1):
            pool.write(layer, loc, x, x)
    assert pool.buffers["layers.0.k"].view(torch.uint8)[5, 0, 0].item() == 0x79  # code 288
    assert pool.buffers["layers.1.v"].view(torch.uint8)[5, 0, 0].item() == 0x71  # code 144
    k0, _ = pool.dequantize(0, loc)
    _, v1 = pool.dequantize(1, loc)
    assert k0[0, 0, 0].item() == 576.0 and v1[0, 0, 0].item() == 576.0  # not 448, 288 or 896


def test_kvb10_json_errors(tmp_path):
    pool = make_pool(layers=2)
    with pytest.raises(ValueError, match=r"no scales for tp rank 1 \(ranks in the file: \['0'\]\)"):
        scales.load_json_scales(pool, KVB10, tp_rank=1)
    drop = json.loads(json.dumps(KVB10))
    del drop["kv_cache"]["scaling_factor"]["0"]["1"]
    with pytest.raises(ValueError, match=r"no KV scale for layer\(s\) 1"):
        scales.load_json_scales(pool, drop)
    e5 = json.loads(json.dumps(KVB10))
    e5["kv_cache"]["dtype"] = "float8_e5m2"
    with pytest.raises(ValueError, match="is for fp8_e5m2, but layer.* are fp8_e4m3"):
        scales.load_json_scales(pool, e5)
    with pytest.raises(ValueError, match="expected"):
        scales.load_json_scales(pool, {"kv": {}})
    bad = json.loads(json.dumps(KVB10))
    bad["kv_cache"]["scaling_factor"]["0"]["1"] = [2.0, -1.0]
    with pytest.raises(ValueError, match="layer 1: v scale = -1.0"):
        scales.load_json_scales(pool, bad)
    bad["kv_cache"]["scaling_factor"]["0"]["1"] = [1, 2, 3]
    with pytest.raises(ValueError, match="layer 1: .* neither a number nor"):
        scales.load_json_scales(pool, bad)
    extra = json.loads(json.dumps(KVB10))
    extra["kv_cache"]["scaling_factor"]["0"]["7"] = 1.0
    with pytest.raises(ValueError, match=r"scales for layers \[7\], the model has 2"):
        scales.load_json_scales(pool, extra)
    # a rank holding a list instead of {layer: scale} was an AttributeError (user review)
    flat = json.loads(json.dumps(KVB10))
    flat["kv_cache"]["scaling_factor"]["0"] = [0.5, 0.25]
    with pytest.raises(ValueError, match=r"tp rank 0 holds \[0.5, 0.25\], expected"):
        scales.load_json_scales(pool, flat)
    assert pool.scales_source is None
    with pytest.raises(ValueError, match="`dtype` = 'int8'"):
        scales.read_json_scales({"kv_cache": {"dtype": "int8", "scaling_factor": {}}})


def test_json_tp_rank_selects_its_scales():
    doc = {
        "kv_cache": {
            "dtype": "float8_e4m3fn",
            "scaling_factor": {"0": {"0": 0.5, "1": 0.5}, "1": {"0": [0.25, 0.125], "1": 3.0}},
        }
    }
    pool = make_pool(layers=2)
    scales.load_json_scales(pool, doc, tp_rank=1)
    assert pool_scales(pool) == [(0.25, 0.125), (3.0, 3.0)]


def test_calibration_fp8_and_power_of_two(tmp_path):
    gen = torch.Generator().manual_seed(0)
    batches = []
    amax_k, amax_v = [0.0, 0.0], [0.0, 0.0]
    for _ in range(3):  # a stream of batches per layer
        for layer in range(2):
            k = torch.randn(5, 2, 16, generator=gen) * (10 * (layer + 1))
            v = torch.randn(5, 2, 16, generator=gen)
            amax_k[layer] = max(amax_k[layer], float(k.abs().max()))
            amax_v[layer] = max(amax_v[layer], float(v.abs().max()))
            batches.append((layer, k, v))
    ks, vs = scales.calibrate(iter(batches), 2, "fp8_e4m3", json_path=tmp_path / "s.json")
    assert ks == [pytest.approx(a / 448, rel=1e-6) for a in amax_k]
    assert vs == [pytest.approx(a / 448, rel=1e-6) for a in amax_v]
    # the written file loads back into a pool, without the missing-scales warning
    pool = make_pool(layers=2)
    scales.load_json_scales(pool, tmp_path / "s.json")
    assert [p[0] for p in pool_scales(pool)] == [pytest.approx(x, rel=1e-6) for x in ks]
    p2k, _ = scales.calibrate(iter(batches), 2, "fp8_e4m3", power_of_two=True)
    for a, s in zip(amax_k, p2k, strict=True):
        e = math.log2(s)
        assert e == int(e) and s >= a / 448 and s / 2 < a / 448
    e5k, _ = scales.calibrate(iter(batches), 2, "fp8_e5m2")
    assert e5k == [pytest.approx(a / 57344, rel=1e-6) for a in amax_k]
    nvk, _ = scales.calibrate(iter(batches), 2, "nvfp4")
    assert nvk == [pytest.approx(a / (6 * 448), rel=1e-6) for a in amax_k]


def test_calibration_errors_and_apply():
    cal = scales.Calibrator(3, "fp8_e4m3")
    cal.observe(0, torch.ones(2, 1, 4) * 448, torch.ones(2, 1, 4) * 896)
    with pytest.raises(ValueError, match=r"no samples for layer\(s\) 1-2"):
        cal.scales()
    cal.observe(1, torch.full((1, 1, 4), float("nan")), None)
    cal.observe(2, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="layer 1: calibration amax is nan"):
        cal.scales()
    with pytest.raises(ValueError, match="`dtype` = 'fp4_mx_block16' has no per-layer scales"):
        scales.Calibrator(2, "fp4_mx_block16")
    with pytest.raises(ValueError, match="`layer` = 5"):
        cal.observe(5, torch.ones(1))
    cal2 = scales.Calibrator(2, "fp8_e4m3")
    cal2.observe(0, torch.ones(1, 1, 4) * 448, torch.ones(1, 1, 4) * 896)
    cal2.observe(1, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    assert cal2.scales() == ([1.0, 1.0], [2.0, 1.0])  # an all-zero layer gets 1.0
    assert cal2.to_json()["kv_cache"]["scaling_factor"]["0"] == {"0": [1.0, 2.0], "1": 1.0}
    pool = make_pool(layers=2)
    cal2.apply(pool)
    assert pool_scales(pool) == [(1.0, 2.0), (1.0, 1.0)] and pool.scales_source == "calibration"


def test_kvb12_e4m3_without_scales_warns_once():
    pool = make_pool(layers=5)
    x = torch.ones(1, 2, 16)
    with pytest.warns(
        MissingKVScalesWarning,
        match=r"5 of 5 KV layers \(layers 0-4\) are fp8_e4m3 "
        r"with k/v scale 1.0.*load_checkpoint_scales",
    ):
        pool.write(0, torch.tensor([4]), x, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.write(1, torch.tensor([5]), x, x)  # once per pool


def test_e5m2_and_nvfp4_without_scales_only_log(caplog):
    for dtype in ("fp8_e5m2", "nvfp4"):
        pool = make_pool(dtype)
        x = torch.ones(1, 2, 16)
        with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="kvpool.scales"):
            warnings.simplefilter("error")
            pool.write(0, torch.tensor([4]), x, x)
        assert "use" in caplog.text and dtype in caplog.text
        caplog.clear()


def test_scales_from_any_source_never_warn(tmp_path):
    save_checkpoint(tmp_path, KVB08)
    for load in (
        lambda p: scales.load_checkpoint_scales(p, tmp_path),
        lambda p: p.set_kv_scales([0.1] * 5, [0.2] * 5),
    ):
        pool = make_pool()
        load(pool)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pool.write(0, torch.tensor([4]), torch.ones(1, 2, 16), torch.ones(1, 2, 16))


# --- API attack: bad input raises naming the value (and layer) and changes nothing ----------


def set_pool(layers=2):
    pool = make_pool(layers=layers)
    pool.set_kv_scales([0.5, 0.25], [2.0, 4.0], source="before")
    return pool, pool_scales(pool)


def test_huge_int_scale_raises_value_error_naming_the_layer(tmp_path):
    pool, before = set_pool()
    with pytest.raises(
        ValueError,
        match=r"`k_scales\[0\]` = 1000.*\(401 chars\): too large for a float.*\(layer 0\)",
    ):
        pool.set_kv_scales([10**400, 1.0], [1.0, 1.0])  # was OverflowError
    with pytest.raises(ValueError, match=r"`v_scales\[1\]` = <an int of 16610 bits>.*\(layer 1\)"):
        pool.set_kv_scales([1.0, 1.0], [1.0, 10**5000])
    path = tmp_path / "kv_scales.json"
    path.write_text(
        '{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 1.0, "1": %s}}}}'
        % ("1" * 400)
    )
    with pytest.raises(ValueError, match=r"layer 1: scale = 1111.*\(400 chars\) is too large"):
        scales.load_json_scales(pool, path)
    assert pool_scales(pool) == before == [(0.5, 2.0), (0.25, 4.0)]
    assert pool.scales_source == "before"


def test_json_non_string_dtype_and_bad_layer_keys_raise_value_error():
    with pytest.raises(ValueError, match=r"`dtype` = \['x'\]; expected one of float8_e4m3fn"):
        scales.read_json_scales({"kv_cache": {"dtype": ["x"], "scaling_factor": {}}})
    for key in (None, 1.5, True, "1_0", " 1", "-1"):
        doc = {"kv_cache": {"dtype": "nvfp4", "scaling_factor": {"0": {key: 1.0}}}}
        with pytest.raises(ValueError, match=rf"layer key {re.escape(repr(key))} is not a layer"):
            scales.read_json_scales(doc)
    with pytest.raises(ValueError, match=r"ranks in the file: \['1', None\]"):
        scales.read_json_scales(
            {"kv_cache": {"dtype": "nvfp4", "scaling_factor": {None: {}, "1": {}}}}
        )


def test_json_duplicate_layers_conflict_like_the_checkpoint_loader(tmp_path):
    pool, before = set_pool()
    doc = {
        "kv_cache": {
            "dtype": "float8_e4m3fn",
            "scaling_factor": {"0": {"0": 0.5, "1": 0.5, "01": 0.25}},
        }
    }
    with pytest.raises(ValueError, match="layer 1: conflicting scales '1': 0.5 and '01': 0.25"):
        scales.load_json_scales(pool, doc)
    raw = '{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 1.0, "1": %s}}}}'
    path = tmp_path / "dup.json"
    path.write_text(raw % '2.0, "1": 3.0')  # json.loads alone keeps the last
    with pytest.raises(ValueError, match="layer 1: conflicting scales '1': 2.0 and '1': 3.0"):
        scales.load_json_scales(pool, path)
    path.write_text(
        raw.replace('"dtype": "float8_e4m3fn"', '"dtype": "float8_e4m3fn", "dtype": "nvfp4"')
        % "2.0"
    )
    with pytest.raises(ValueError, match="has key 'dtype' twice, with different values"):
        scales.load_json_scales(pool, path)
    assert pool_scales(pool) == before and pool.scales_source == "before"
    # identical duplicates are accepted, as the checkpoint loader accepts equal duplicates
    path.write_text(raw % '[2.0, 4.0], "01": [2.0, 4.0], "1": [2.0, 4.0]')
    scales.load_json_scales(pool, path)
    assert pool_scales(pool) == [(1.0, 1.0), (2.0, 4.0)]


def test_set_kv_scales_accepts_real_number_scalars():
    pool = make_pool(layers=2)
    pool.set_kv_scales([np.float32(0.5), torch.tensor(0.25)], [np.int64(2), torch.tensor(4)])
    assert pool_scales(pool) == [(0.5, 2.0), (0.25, 4.0)]
    pool.set_kv_scales(torch.tensor([0.125, 8.0]), np.array([0.5, 1.0]))
    assert pool_scales(pool) == [(0.125, 0.5), (8.0, 1.0)]


@pytest.mark.parametrize(
    "bad, msg",
    [
        (True, "True: scales are real numbers"),
        (np.True_, "np.True_: scales are real numbers"),
        (torch.tensor(True), r"tensor\(True\): scales are real numbers"),
        ("0.5", "'0.5': scales are real numbers"),
        (torch.tensor([0.5]), r"tensor\(\[0.5000\]\): scales are real numbers"),
        (float("nan"), "nan: scales must be finite and > 0"),
        (np.float64("inf"), "inf: scales must be finite and > 0"),
        (torch.tensor(0.0), "0.0: scales must be finite and > 0"),
        (np.float32(-1.0), "-1.0: scales must be finite and > 0"),
    ],
)
def test_set_kv_scales_refuses_non_real_or_bad_scalars_naming_the_layer(bad, msg):
    pool, before = set_pool()
    with pytest.raises(ValueError, match=rf"`k_scales\[1\]` = {msg}.*\(layer 1\)"):
        pool.set_kv_scales([1.0, bad], [1.0, 1.0])
    assert pool_scales(pool) == before and pool.scales_source == "before"


def test_calibrator_layer_count_and_index_are_ints():
    for n in (2.5, True, 0, -1, "2"):
        with pytest.raises(
            ValueError, match=r"`num_layers` = .*: the layer count must be an int >= 1"
        ):
            scales.Calibrator(n, "fp8_e4m3")
    assert scales.Calibrator(np.int64(2), "fp8_e4m3").num_layers == 2
    cal = scales.Calibrator(2, "fp8_e4m3")
    cal.observe(0, torch.full((1, 1, 4), 448.0))
    for layer in (0.5, True, np.True_, torch.tensor(True), "1"):
        with pytest.raises(ValueError, match=r"`layer` = .*: a layer index must be an int"):
            cal.observe(layer, torch.full((1, 1, 4), 896.0))
    with pytest.raises(ValueError, match="layer 1: `v` is a list, not a tensor"):
        cal.observe(1, torch.full((1, 1, 4), 896.0), [1.0])  # k is not folded in either
    assert cal.amax() == ({0: 448.0}, {0: 448.0})
    cal.observe(np.int64(1), torch.full((1, 1, 4), 896.0))
    assert cal.scales() == ([1.0, 2.0], [1.0, 2.0])
