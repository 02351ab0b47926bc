"""Review of the MLA decode routing and the Gluon knobs (CPU; planners only, no kernel runs).

- ``plan_mla_decode`` refuses an unknown ``kernel`` whatever ``dots`` says.
- ``mla_small``'s default register prefetch follows the warps: ``num_warps=8`` alone plans
  (the prefetch is refused only where asked for).
- The default routing documented in ``plan_mla_decode`` (``mla_gluon`` above 32 heads for
  bf16/fp16/fp8_e4m3 on Hopper, no tile knob, ``KVPOOL_MLA_GLUON`` not ``0``; ``mla_small`` at
  <= 32 heads) is what the planner does (device check patched: CPU caches).
- ``GluonKnobs.rescale`` out of range (non-finite, or >= 16: P is rounded to fp16) is refused.
"""

import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool import attention  # noqa: E402
from kvpool.attention import GluonKnobs, mla_gluon, mla_small  # noqa: E402
from kvpool.attention import gluon_knobs as gk  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from test_mla import Latent  # noqa: E402


@pytest.mark.parametrize("kernel", ["bogus", "mla_smal", 7])
def test_unknown_kernel_refused_with_fp8_dots(kernel):
    c = Latent("fp8_e4m3", [40, 3], rank=64, rope=32)
    with pytest.raises(ValueError, match="`kernel` = .*MLA decode kernels are"):
        attention.plan_mla_decode(c.view, 16, c.page_table, c.seq_lens, kv_lora_rank=64,
                                  kernel=kernel, dots="fp8")  # fmt: skip


def test_small_default_prefetch_yields_to_explicit_warps():
    c = Latent("fp8_e4m3", [40, 3])
    p = attention.plan_mla_decode(c.view, 16, c.page_table, c.seq_lens, kv_lora_rank=32,
                                  num_warps=8)  # fmt: skip
    assert (p.kernel, p.num_warps, p.prefetch) == ("mla_small", 8, False)
    # asked for: still refused, naming the value
    with pytest.raises(ValueError, match="`prefetch` with `num_warps` = 8"):
        mla_small.plan_mla_small_decode(c.view, 16, c.page_table, c.seq_lens, kv_lora_rank=32,
                                        num_warps=8, prefetch=True)  # fmt: skip


def _deepseek(dtype):
    return Latent(dtype, [40, 3], rank=512, rope=64)


def test_default_routing_matches_the_docstring(monkeypatch):
    monkeypatch.setattr(mla_gluon, "_device_unfit", lambda device: None)  # (as on an H200)
    monkeypatch.delenv(mla_gluon.MLA_GLUON_ENV, raising=False)
    monkeypatch.delenv(mla_small.MLA_SMALL_ENV, raising=False)

    def kernel(dtype, h=128, **kw):
        c = _deepseek(dtype)
        return attention.plan_mla_decode(c.view, h, c.page_table, c.seq_lens, kv_lora_rank=512,
                                         **kw).kernel  # fmt: skip

    for dtype in ("bf16", "fp16", "fp8_e4m3"):
        assert kernel(dtype) == "mla_gluon", dtype
        assert kernel(dtype, 33) == "mla_gluon", dtype
        assert kernel(dtype, 32) == "mla_small", dtype
        assert kernel(dtype, num_splits=3) == "mla_gluon", dtype  # (not a tile knob)
        assert kernel(dtype, dots="f16") == "mla_gluon", dtype
        for knob in ("block_n", "num_stages"):
            assert kernel(dtype, **{knob: 2 if knob == "num_stages" else 32}) == "mla_triton"
    assert kernel("fp8_e4m3", dots="fp8") == "mla_triton"
    for dtype in ("fp8_e5m2", "nvfp4", "fp32"):  # (e5m2 untimed: opt-in)
        assert kernel(dtype) == "mla_triton", dtype
    assert kernel("fp8_e5m2", kernel="mla_gluon") == "mla_gluon"
    monkeypatch.setenv(mla_gluon.MLA_GLUON_ENV, "0")
    assert kernel("bf16") == "mla_triton"
    assert kernel("bf16", kernel="mla_gluon") == "mla_gluon"
    monkeypatch.setenv(mla_small.MLA_SMALL_ENV, "0")
    assert kernel("bf16", 16) == "mla_triton"


def test_gluon_module_docstring_is_not_stale():
    assert "Opt-in only" not in mla_gluon.__doc__


SMOL = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            vocab_size=100)  # fmt: skip


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("rescale", [float("inf"), float("nan"), 16.0, 1e9])
def test_rescale_out_of_range_refused(multi, rescale):
    spec = ModelSpec.from_dict(SMOL, name="smol", dtype="bf16")
    view = kvpool.KVPool(kvpool.size_for(spec, "fp8_e4m3", num_tokens=4096, page_size=16),
                         "cpu").layer(0)  # fmt: skip
    why = gk.knobs_unfit(view, 3, GluonKnobs(multi=multi, rescale=rescale))
    assert why is not None and "rescale" in why
    assert gk.knobs_unfit(view, 3, GluonKnobs(multi=multi, rescale=8.0)) is None
    assert gk.knobs_unfit(view, 3, GluonKnobs(multi=multi, rescale=-1.0)) is None


@pytest.mark.parametrize("bad", [0, -5, 2.7, True, "abc"])
def test_max_seq_len_checked_by_every_mla_planner(bad, monkeypatch):
    monkeypatch.setattr(mla_gluon, "_device_unfit", lambda device: None)
    c = _deepseek("bf16")
    planners = [
        lambda **kw: attention.plan_mla_decode(c.view, 16, c.page_table, c.seq_lens, **kw),
        lambda **kw: attention.plan_mla_decode(c.view, 128, c.page_table, c.seq_lens, **kw),
        lambda **kw: attention.plan_mla_decode(
            c.view, 128, c.page_table, c.seq_lens, kernel="mla_triton", **kw
        ),  # fmt: skip
        lambda **kw: mla_small.plan_mla_small_decode(c.view, 16, c.page_table, c.seq_lens, **kw),
        lambda **kw: mla_gluon.plan_mla_gluon_decode(c.view, 128, c.page_table, c.seq_lens, **kw),
    ]
    for plan in planners:
        with pytest.raises(ValueError, match="`max_seq_len` = "):
            plan(kv_lora_rank=512, max_seq_len=bad)
        assert plan(kv_lora_rank=512, max_seq_len=100).num_splits >= 1


def test_bad_knobs_env_is_named(monkeypatch):
    monkeypatch.setenv(gk.KNOBS_ENV, "multi=2")
    with pytest.raises(ValueError, match="KVPOOL_GLUON_KNOBS.*bad value in 'multi=2'"):
        gk.env_knobs()
    monkeypatch.setenv(gk.KNOBS_ENV, "  ")
    assert gk.env_knobs() is None


def test_mla_extend_plan_takes_the_host_cu_seqlens():
    """``plan_extend(host_cu_seqlens_q=)`` on an MLA layer builds its work list from the numpy
    copy (no device read): the same (request, first token) pairs as from the tensor."""
    import numpy as np

    c = Latent("bf16", [40, 3, 17], rank=32, rope=16)
    cu = np.array([0, 5, 6, 26], dtype=np.int32)
    dev = torch.from_numpy(cu)
    kw = {"kv_lora_rank": 32}
    a = attention.plan_extend(c.view, 16, dev, c.page_table, c.seq_lens, **kw)
    b = attention.plan_extend(c.view, 16, dev, c.page_table, c.seq_lens, host_cu_seqlens_q=cu, **kw)
    assert a.work.tolist() == b.work.tolist() and len(a.work) > 3
    bad = np.array([0, 5, 4, 26], dtype=np.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention.plan_extend(
            c.view, 16, dev, c.page_table, c.seq_lens, host_cu_seqlens_q=bad, **kw
        )


@pytest.mark.parametrize("bad", [0, -5, "abc"])
def test_plan_decode_checks_max_seq_len(bad):
    from attention_helpers import Cache

    c = Cache("bf16", [40, 3], heads=2, d=64, page=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        attention.plan_decode(c.view, 4, c.page_table, c.seq_lens, max_seq_len=bad)
