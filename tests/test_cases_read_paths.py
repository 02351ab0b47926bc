"""Failure cases KVB-12/13/14 (docs/architecture.md) through every *read* path: the byte-level
write tests (test_write.py, test_formats.py) prove what is stored; these prove that every reader
decodes those bytes as the same format (KVB-13's fault was a reader and a writer disagreeing
about e4m3 vs e5m2).

Oracle, worked by hand: with a single cached token, softmax over one key is exactly 1, so decode
and extend must return that token's V exactly as its format decodes it (every value below is
representable in bf16, and a scale of 1.0 folds away exactly). The wrong-format readings are
written out too, so a regression names the fault.
"""

import pytest

torch = pytest.importorskip("torch")

from test_write import MODES, backend_for, device_for, make_pool, pool_write, set_scales  # noqa: E402

# (dtype, values written as V, what a correct reader returns, what the KVB-13 fault would return)
E5M2 = [1.0, 2.0, 3.5, 0.25, 1000.0, 70000.0]
E4M3 = [1000.0, -600.0, 3.0, 0.01, 464.0, 1.0]
MX_B0 = [3.2, 1.0, -0.3, 0, 0.6, -1.4, 2.2, 0.1, 0, 0, 0, 0, 0, 0, 0, -3.2]
MX_B1 = [19.0, -7.2, 5.4, 1.2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -13.0]
CASES = [
    # e5m2 bytes 3C 40 43 34 64 7B; read as e4m3 they would be 1.5, 2, 2.75, 0.75, ...
    ("fp8_e5m2", 16, E5M2 + [0.0] * 10, [1.0, 2.0, 3.5, 0.25, 1024.0, 57344.0] + [0.0] * 10),
    # e4m3 saturates at 448 (KVB-12), 0.01 -> 0x05 = 0.009765625
    ("fp8_e4m3", 16, E4M3 + [0.0] * 10, [448.0, -448.0, 3.0, 0.009765625, 448.0, 1.0] + [0.0] * 10),
    # KVB-14: block scales 2^0 and 2^2, nibble 2i low
    (
        "fp4_mx_block16",
        32,
        MX_B0 + MX_B1,
        [3, 1, -0.5, 0, 0.5, -1.5, 2, 0, 0, 0, 0, 0, 0, 0, 0, -3]
        + [16, -8, 6, 2]
        + [0] * 11
        + [-12],
    ),
]
WRONG_E5M2_AS_E4M3 = [1.5, 2.0, 2.75, 0.75]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,head_dim,vals,want", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("page_size", [1, 4])
def test_single_token_attention_returns_v_as_its_format_decodes_it(
    mode, dtype, head_dim, vals, want, page_size
):
    dev = device_for(mode)
    pool = make_pool(
        dtype, dev, heads=1, head_dim=head_dim, page_size=page_size, num_tokens=8, layers=1
    )
    if dtype.startswith("fp8"):
        set_scales(pool, 1.0, 1.0)
    x = torch.tensor(vals, dtype=torch.float32)[None, None, :].to(dev)
    page = 2
    pool_write(pool, mode, torch.tensor([page * page_size], device=dev), x, x)

    backend = backend_for(mode)
    q = torch.randn(1, 2, head_dim, generator=torch.Generator().manual_seed(0))
    q = q.to(torch.bfloat16).to(dev)
    page_table = torch.tensor([[page]], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([1], dtype=torch.int32, device=dev)
    dec = pool.decode(0, q, page_table, seq_lens, backend=backend)
    ext = pool.extend(
        0,
        q[:1].reshape(1, 2, head_dim),
        torch.tensor([0, 1], dtype=torch.int32, device=dev),
        page_table,
        seq_lens,
        backend=backend,
    )
    for name, out in (("decode", dec), ("extend", ext)):
        assert out.shape == (1, 2, head_dim), name
        for h in range(2):  # both query heads of the GQA group read the one KV head
            got = out[0, h].float().cpu().tolist()
            kvb13 = " (e5m2 bytes read as e4m3: KVB-13)" if got[:4] == WRONG_E5M2_AS_E4M3 else ""
            assert got == want, f"{name} head {h}: {got}{kvb13}"
