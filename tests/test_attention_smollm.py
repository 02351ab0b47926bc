"""Fused paged attention at the geometry of the model used end to end, SmolLM2-135M:
head_dim 64, 9 query heads over 3 KV heads (GQA group 3, not a power of two), page_size 1 and 16.

Every KV dtype, decode and ragged extend (prefixes that end mid-page, an empty prefix, a request
with no new tokens, seq_len 1), against the fp64 oracle of attention_helpers (dense dequantized K/V,
no paging code shared with the launchers). The interpreted tests keep the shapes tiny; the GPU
tests run the same geometry at real lengths, every decode/extend path (default plans, no split,
many splits, the word-level FP4/fp8 decode on and off), and check decode against one-token extends.
"""

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import (  # noqa: E402
    DTYPES,
    TOL,
    WORDS,
    Cache,
    rel_err,
    run_decode,
    run_extend,
)
from kvpool import attention  # noqa: E402

HQ, HK, D = 9, 3, 64


# ----------------------------------------------------------------------------- interpreted


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16])
def test_smollm_decode_interpret(dtype, page):
    cache = Cache(dtype, [1, 18, 33], heads=HK, d=D, page=page, heavy=dtype != "fp32")
    kws = (
        {"num_splits": 2, "block_n": 16},
        {"num_splits": 1, "block_n": 16},
        {"num_splits": 2, "block_n": 16, "swap": True},
    )
    for kw in kws:
        out, ref = run_decode(cache, HQ, backend="triton", plan_kw=kw)
        assert rel_err(out, ref) < TOL[dtype], kw


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16])
def test_smollm_extend_interpret(dtype, page):
    # prefixes 17 (mid-page), 0, 16, 0, 22 (mid-page), 145 (whole KV tiles before the first
    # query: the unmasked loop); request 2 has no new tokens
    lens = [21, 6, 16, 1, 27, 150]
    cache = Cache(dtype, lens, heads=HK, d=D, page=page, heavy=dtype != "fp32")
    out, ref = run_extend(cache, HQ, [4, 6, 0, 1, 5, 5], backend="triton")
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", WORDS)
def test_smollm_word_decode_interpret(dtype):
    cache = Cache(dtype, [19, 3], heads=HK, d=D, page=16, heavy=True)
    out, ref = run_decode(
        cache, HQ, backend="triton", plan_kw={"num_splits": 2, "block_n": 16, "asm": True}
    )
    assert rel_err(out, ref) < TOL[dtype]
    out, ref = run_extend(cache, HQ, [7, 3], backend="triton", use_plan=True, plan_kw={"asm": True})
    assert rel_err(out, ref) < TOL[dtype]


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16])
def test_smollm_decode_gpu(dtype, page):
    lens = [1, 15, 16, 17, 100, 517, 2049]
    cache = Cache(dtype, lens, heads=HK, d=D, page=page, device="cuda", heavy=dtype != "fp32")
    kws = [{}, {"num_splits": 1}, {"num_splits": 7, "block_n": 32, "swap": False}]
    if dtype in WORDS:
        kws += [{"asm": False}]
    for kw in kws:
        out, ref = run_decode(cache, HQ, backend="triton", device="cuda", plan_kw=kw)
        assert rel_err(out, ref) < TOL[dtype], kw


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16])
def test_smollm_extend_gpu(dtype, page):
    # prefixes 283 (mid-page), 0, 64, 0, 1 (mid-page), 100
    lens = [300, 45, 80, 1, 2, 100]
    qlens = [17, 45, 16, 1, 1, 0]
    cache = Cache(dtype, lens, heads=HK, d=D, page=page, device="cuda", heavy=dtype != "fp32")
    kws = [None, {"block_t": 16, "block_n": 64, "num_warps": 4}]
    if dtype in WORDS:
        kws += [{"asm": dtype not in ("nvfp4", "fp4_mx_block16")}]  # the other FP4/fp8 path
    for kw in kws:
        out, ref = run_extend(
            cache,
            HQ,
            qlens,
            backend="triton",
            device="cuda",
            use_plan=kw is not None,
            plan_kw=kw,
        )
        assert rel_err(out, ref) < TOL[dtype], kw


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_smollm_decode_equals_one_token_extend_gpu(dtype):
    """The last token of each request through decode and through a one-token extend: two
    different kernels over the same pages must agree to the rounding of their outputs."""
    lens = [5, 64, 333]
    cache = Cache(dtype, lens, heads=HK, d=D, page=16, device="cuda")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), HQ, D, generator=gen).to(torch.bfloat16).cuda()
    dec = attention.decode(cache.view, q, cache.page_table, cache.seq_lens)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    ext = attention.extend(cache.view, q, cu, cache.page_table, cache.seq_lens)
    ref = attention.reference_decode(cache.view, q, cache.page_table, cache.seq_lens)
    scale = ref.abs().max().item()
    assert (dec.float() - ref).abs().max().item() < TOL[dtype] * scale
    assert (ext.float() - ref).abs().max().item() < TOL[dtype] * scale


# ----------------------------------------------------------------------------- in a model


@pytest.mark.interpret
@pytest.mark.parametrize("page", [1, 16])
def test_smollm_geometry_model_triton_matches_torch_interpret(page):
    """A 2-layer random Llama with SmolLM2-135M's attention geometry (9 q heads, 3 KV heads,
    head_dim 64; small hidden size and vocabulary) through a bf16 pool: the Triton kernels
    (interpreted; per-step plans shared by the layers) and the torch reference attention read
    the same pool contents and must give the same logits. Request 0 prefills in two parts (a
    prefix ending mid-page), then both requests decode 3 tokens."""
    import numpy as np
    from kvpool import fidelity
    from kvpool.llama import Step
    from llama_fixtures import TINY, tiny_llama

    cfg = {**TINY, "hidden_size": 96, "intermediate_size": 128, "num_attention_heads": HQ,
           "num_key_value_heads": HK, "head_dim": D}  # fmt: skip
    model = tiny_llama(seed=3, config=cfg)
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randint(0, 97, (13,), generator=gen).tolist()
    p1 = torch.randint(0, 97, (7,), generator=gen).tolist()
    pages = [np.arange(1, 25, dtype=np.int32), np.arange(25, 49, dtype=np.int32)]
    out = {}
    for backend in ("triton", "torch"):
        model.attn_backend = backend
        pool = fidelity.pool_for(model, "bf16", 64 * 16, page_size=page)
        rows = [model.forward(pool, torch.tensor(p0[:5]), Step.build(pages[:1], [0], [5], page),
                              all_logits=True)]  # fmt: skip
        step = Step.build(pages, [5, 0], [len(p0) - 5, len(p1)], page)
        rows.append(model.forward(pool, torch.tensor(p0[5:] + p1), step, all_logits=True))
        seq = [len(p0), len(p1)]
        for t in range(3):
            rows.append(model.forward(pool, torch.tensor([t + 1, t + 2]),
                                      Step.build(pages, seq, [1, 1], page)))  # fmt: skip
            seq = [x + 1 for x in seq]
        out[backend] = torch.cat(rows)
    a, b = out["triton"], out["torch"]
    # the same bf16 K/V; the interpreter's dots run in fp32 (q and p unrounded): close agreement
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
