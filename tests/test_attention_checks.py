"""Bad input to kvpool.attention: errors name the argument and its value, change nothing, and
come before any launch (the review of the attention API: option types, page ids, the padding
page, debug checks on the GPU).
"""

import re

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import (  # noqa: E402
    Cache,
    _attack_cache,
    _i32,
)
from kvpool import attention  # noqa: E402

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu


# --------------------------------------------------------------------------------------- host


def test_errors_name_the_argument():
    cache = Cache("bf16", [4], heads=2, d=16, page=4)
    pt, sl = cache.page_table, cache.seq_lens
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="`q`"):
        attention.decode(cache.view, q[..., :8], pt, sl)
    with pytest.raises(ValueError, match="`q` has 3 heads"):
        attention.decode(cache.view, q[:, :3], pt, sl)
    with pytest.raises(ValueError, match="`page_table`"):
        attention.decode(cache.view, q, pt.long(), sl)
    with pytest.raises(ValueError, match="`seq_lens`"):
        attention.decode(cache.view, q, pt, torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="`window`"):
        attention.decode(cache.view, q, pt, sl, window=0)
    with pytest.raises(ValueError, match="`softcap`"):
        attention.decode(cache.view, q, pt, sl, softcap=-1.0)
    with pytest.raises(ValueError, match="`sinks`"):
        attention.decode(cache.view, q, pt, sl, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="`sm_scale`"):
        attention.decode(cache.view, q, pt, sl, sm_scale=float("nan"))
    with pytest.raises(ValueError, match="`backend`"):
        attention.decode(cache.view, q, pt, sl, backend="cuda")
    with pytest.raises(ValueError, match="`cu_seqlens_q`"):
        attention.extend(cache.view, q, torch.tensor([0, 1, 2], dtype=torch.int32), pt, sl)
    with pytest.raises(ValueError, match="`page_table` and `seq_lens` are required"):
        attention.decode(cache.view, q)


def test_reference_path_refuses_pages_outside_the_pool():
    """Found by the user review of 2026-11-29: on the torch path a page id of -1 wrapped to the
    pool's last rows silently, one past the end raised a bare IndexError from torch, and a
    seq_len beyond the page table did the same."""
    cache = Cache("bf16", [4], heads=2, d=16, page=4)  # 1 + 1 + 3 extra pages = 5 pages
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    assert cache.page_table.shape == (1, 3) and cache.view.k.shape[0] == 5 * 4
    for bad in (-1, 5, 1 << 30):
        pt = cache.page_table.clone()
        pt[0, 0] = bad
        for call in (
            lambda: attention.decode(cache.view, q, pt, cache.seq_lens, backend="torch"),
            lambda: attention.extend(cache.view, q, torch.tensor([0, 1], dtype=torch.int32), pt,
                                     cache.seq_lens, backend="torch"),
        ):
            with pytest.raises(ValueError, match=rf"`page_table\[0, 0\]` = {bad} is outside the "
                                                 r"pool's pages 0\.\.4"):
                call()
    pt = cache.page_table.clone()
    pt[0, 0] = 4  # the last page is fine
    attention.decode(cache.view, q, pt, cache.seq_lens, backend="torch")
    with pytest.raises(ValueError, match=r"`seq_lens\[0\]` = 13 exceeds the page table's 3 pages"):
        attention.decode(cache.view, q, cache.page_table, torch.tensor([13], dtype=torch.int32),
                         backend="torch")


NOT_NUMBERS = [True, False, "x", "1.0", None, torch.tensor(1.0), [1.0], 1j]


@pytest.mark.parametrize("what", ["decode", "extend"])
@pytest.mark.parametrize(
    "kw, msg",
    [
        *[({"sm_scale": v}, f"`sm_scale` = {v!r}: must be") for v in NOT_NUMBERS if v is not None],
        *[({"softcap": v}, f"`softcap` = {v!r}: must be") for v in NOT_NUMBERS if v is not None],
        *[
            ({k: v}, f"`{k}` = {v!r}: must be finite and > 0")
            for k in ("sm_scale", "softcap")
            for v in (float("nan"), float("inf"), -float("inf"), 0.0, -1, 10**400)
        ],
        *[
            ({"window": v}, f"`window` = {v!r}: must be an int >= 1")
            for v in (True, False, float("nan"), float("inf"), 4.0, "4", 0, -3)
        ],
    ],
)
def test_options_refuse_bools_strings_and_non_finite_values(what, kw, msg):
    """Before: window=True raised a torch NotImplementedError, NaN/Inf windows "cannot convert
    float NaN to integer"/OverflowError, sm_scale/softcap "x" an unnamed float() error, and
    sm_scale=True / softcap=True passed as 1.0."""
    c = _attack_cache()
    q = torch.randn(1, 4, 16).to(torch.bfloat16)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=re.escape(msg)):
            if what == "decode":
                attention.decode(c.view, q, c.page_table, c.seq_lens, backend=backend, **kw)
            else:
                attention.extend(
                    c.view, q, _i32(0, 1), c.page_table, c.seq_lens, backend=backend, **kw
                )


def test_options_accept_numpy_scalars_and_huge_windows():
    np = pytest.importorskip("numpy")
    c = _attack_cache()
    q = torch.randn(1, 4, 16).to(torch.bfloat16)
    ref = attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.25, window=4,
                           softcap=30.0)
    for sm, win, cap in [(np.float32(0.25), np.int64(4), np.float64(30.0)),
                         (np.float64(0.25), np.int32(4), np.int64(30)), (0.25, 4, 30)]:
        got = attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=sm, window=win,
                               softcap=cap)
        assert torch.equal(got, ref)
        got = attention.extend(c.view, q, _i32(0, 1), c.page_table, c.seq_lens, sm_scale=sm,
                               window=win, softcap=cap)
        assert torch.equal(got, ref)
    # a window longer than any sequence (beyond int32) is no window
    full = attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.25)
    for win in (8, 1 << 40, np.int64(1 << 62)):
        assert torch.equal(
            attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.25, window=win), full
        )
    assert attention._check_options(1 << 40, np.float32(2), None, 4, "cpu") == ((1 << 31) - 1, 2.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton on CPU: checked before launch
def test_bad_page_ids_refused_padding_page_allowed(backend):
    """Ids outside the pool's pages are refused before any read (the torch path indexed out of
    range, or read wrong rows for negative ids). Page 0, the padding page, is allowed: the
    padded requests of a fixed-size batch (a CUDA graph's) point at it; what it holds is
    garbage. Ids past a request's seq_len are never read, so anything goes there."""
    c = _attack_cache()  # 1 + 2 + 3 extra pages = 6 pages
    assert c.view.k.shape[0] == 6 * 4
    q = torch.randn(1, 4, 16).to(torch.bfloat16)
    sl = _i32(8)
    cu = _i32(0, 1)
    for row, bad, msg in [
        ([1, -1], (0, 1), r"`page_table\[0, 1\]` = -1 is outside the pool's pages 0\.\.5 "
                          r"\(request 0, seq_len 8\)"),
        ([6, 2], (0, 0), r"`page_table\[0, 0\]` = 6 is outside the pool's pages 0\.\.5"),
    ]:
        pt = _i32(*row, 0, -5).reshape(1, 4)
        out = torch.full((1, 4, 16), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=msg):
            attention.decode(c.view, q, pt, sl, backend=backend, out=out)
        with pytest.raises(ValueError, match=msg):
            attention.extend(c.view, q, cu, pt, sl, backend=backend, out=out)
        assert bool((out == 7).all()), bad
    if backend == "torch":
        with pytest.raises(ValueError, match="is outside the pool's pages"):
            attention.reference_decode(c.view, q, _i32(1, -2).reshape(1, 2), sl)
        with pytest.raises(ValueError, match="is outside the pool's pages"):
            attention.reference_extend(c.view, q, cu, _i32(9, 2).reshape(1, 2), sl)
        # a padded request: seq_len 1 on the padding page; a real one beside it is exact
        c2 = Cache("bf16", [8], heads=2, d=16, page=4)
        q2 = torch.randn(2, 4, 16).to(torch.bfloat16)
        pt2 = torch.cat([c2.page_table[:, :2], torch.zeros(1, 2, dtype=torch.int32)])
        o = attention.decode(c2.view, q2, pt2, _i32(8, 1), backend="torch")
        ref = attention.decode(c2.view, q2[:1], c2.page_table[:, :2], _i32(8), backend="torch")
        assert torch.equal(o[:1], ref)
    # entries past seq_len (4 tokens: one page) are not read: garbage there is fine
    pt = _i32(c.page_table[0, 0].item(), 0, -5, 99).reshape(1, 4)
    attention.decode(c.view, q, pt, _i32(4), backend="torch")
    # the second request of a batch is named
    c2 = Cache("bf16", [8, 5], heads=2, d=16, page=4)
    pt2 = c2.page_table.clone()
    pt2[1, 1] = -3
    with pytest.raises(ValueError, match=r"`page_table\[1, 1\]` = -3 .* \(request 1, seq_len 5\)"):
        attention.decode(c2.view, torch.randn(2, 4, 16).to(torch.bfloat16), pt2, c2.seq_lens,
                         backend=backend)


# --------------------------------------------------------------------------- GPU, real shapes


@gpu
def test_batch_value_checks_on_the_gpu_are_a_debug_option():
    """On CUDA tensors the kernel path reads no device values unless ``debug=True``."""
    c = Cache("bf16", [8], heads=2, d=16, page=4, device="cuda")
    q = torch.randn(1, 4, 16, device="cuda").to(torch.bfloat16)
    pt = torch.tensor([[1, 1 << 20]], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="is outside the pool's pages"):
        attention.decode(c.view, q, pt, c.seq_lens, debug=True)
    with pytest.raises(ValueError, match=r"`cu_seqlens_q\[1\]` = 2: must equal T = 1"):
        attention.extend(c.view, q, cu, c.page_table, c.seq_lens, debug=True)
