import json
import struct
import subprocess
import sys

import pytest

import kvpool
from kvpool.cli import main

GIB = 1 << 30


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.setenv("NO_COLOR", "1")


def test_size_all_dtypes_llama8b(capsys):
    # 16 GiB fake device, no weights, mem_frac 0.5 -> 8 GiB budget; bf16 131,072 B/token
    rc = main(["size", "meta-llama/Llama-3.1-8B", "--total-memory", "16", "--weights", "0",
               "--mem-fraction-static", "0.5", "--context-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "KV Cache is allocated. dtype: bf16, #tokens: 65535, K size: 4.00 GB, V size: 4.00 GB" in out
    # fp8: floor((8 GiB - 256) / 65,536) - 1 = 131,070
    assert "dtype: fp8_e4m3, #tokens: 131070," in out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if line.startswith("│")}
    assert rows["bf16"] == ["131,072", "65,535", "1.00x", "15", "8.00"]
    assert rows["nvfp4"][0] == "36,864" and rows["nvfp4"][2] == "3.56x"
    assert rows["fp8_e4m3"][3] == "31"  # 131,070 // 4,096


def test_size_json(capsys):
    rc = main(["size", "Qwen/Qwen3-8B", "--kv-cache-dtype", "fp8", "--total-memory", "80",
               "--available-memory", "60", "--mem-fraction-static", "0.85", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(data) == 1
    d = data[0]
    assert d["dtype"] == "fp8_e4m3" and d["bytes_per_token"] == 73_728
    assert d["budget_bytes"] == 48 * GIB  # 60 - 80 x 0.15
    assert d["num_tokens"] == (48 * GIB - 36 * 2 * 4) // 73_728 - 1


def test_bad_input_exit_code_and_message(capsys):
    assert main(["size", "Qwen/Qwen3-8B", "--kv-cache-dtype", "fp6", "--gpu", "H100"]) == 2
    assert "unknown KV cache dtype `fp6`" in capsys.readouterr().err
    assert main(["size", "Qwen/Qwen3-8B", "--gpu", "K80"]) == 2
    assert "unknown GPU `K80`" in capsys.readouterr().err


def test_models_lists_bundled(capsys):
    assert main(["models"]) == 0
    assert "deepseek-ai/DeepSeek-V3" in capsys.readouterr().out.split()


def test_import_and_size_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import kvpool\n"
        "p = kvpool.size_for('Qwen/Qwen3-8B', 'nvfp4', gpu='H200')\n"
        "assert p.bytes_per_token == 41472, p\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("args, text", [
    (["--total-memory", "inf"], "GiB"),
    (["--total-memory", "16", "--page-size", "99999999999999999999"], "--page-size"),
    (["--total-memory", "16", "--context-len", "0"], "context-len"),
    # found by the user review of 2026-11-29: these printed the SGLang lines before failing
    # (context), or said ">= 0" for a page size whose minimum is 1
    (["--total-memory", "16", "--context-len", str(1 << 64)], "--context-len must be in"),
    (["--total-memory", "16", "--page-size", "-1"], "`--page-size` must be >= 1, got -1"),
])
def test_cli_bad_numbers_exit_2(args, text, capsys):
    with pytest.raises(SystemExit) if args[1] == "inf" else _nullcontext():
        rc = main(["size", "Qwen/Qwen3-8B", *args])
        assert rc == 2
    captured = capsys.readouterr()
    assert text in captured.err and "Traceback" not in captured.err
    assert "KV Cache" not in captured.out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B"])
def test_size_names_the_model(capsys, model):
    """The report's first line names the model asked for (a loop variable in the config parser
    once shadowed the name, and every model printed as `index_topk`)."""
    from kvpool.config import ModelSpec

    assert ModelSpec.from_pretrained(model).name == model
    assert ModelSpec.from_dict({"num_hidden_layers": 2, "num_attention_heads": 4,
                                "hidden_size": 256}, name="mine").name == "mine"
    rc = main(["size", model, "--total-memory", "16", "--weights", "0"])
    first = capsys.readouterr().out.splitlines()[0]
    assert rc == 0 and first.startswith(f"{model}: ")


@pytest.mark.parametrize("model, text", [
    ("", "`model` is an empty string"),  # was: "model directory `.` has no config.json"
    ("latin1", "is not UTF-8 text"),  # was: a bare UnicodeDecodeError naming no file
])
def test_cli_bad_model_names_it(model, text, tmp_path, capsys):
    if model == "latin1":
        model = str(tmp_path / "config.json")
        (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    rc = main(["size", model, "--total-memory", "16", "--weights", "0"])
    captured = capsys.readouterr()
    assert rc == 2 and "ModelConfigError" in captured.err and text in captured.err
    assert captured.out == ""


def _rows(out):
    return {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if line.startswith("│")}


def _llama_head_dim_72(tmp_path):
    """The bundled Llama-3.1-8B config.json with `head_dim` 72 (not a multiple of 16: no FP4)."""
    from importlib import resources

    path = resources.files("kvpool") / "models" / "meta-llama--Llama-3.1-8B.json"
    config = json.loads(path.read_text()) | {"head_dim": 72}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "config.json")


FP4_MSG = ("{} needs head dims that are multiples of 16 (one block scale per 16 values); "
           "layer 0 has `head_dim` = 72")


def test_size_all_lists_the_dtypes_that_fit_and_says_why_not(tmp_path, capsys):
    """`--kv-cache-dtype all` failed as a whole (exit 2, no table) when one dtype could not be
    laid out; now that dtype gets a row of `-` and a line with the error, the rest are sized."""
    model = _llama_head_dim_72(tmp_path)
    rc = main(["size", model, "--total-memory", "16", "--weights", "0",
               "--mem-fraction-static", "0.5", "--context-len", "4096"])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0 and captured.err == ""
    # 8 GiB = 8,589,934,592 B; bf16: 32 layers x (K + V) x 8 heads x 72 x 2 B = 73,728 B/token,
    # 8,589,934,592 // 73,728 = 116,508 rows, one the padding row: 116,507 tokens, 28 requests
    # of 4,096; fp32 147,456 B -> 58,254 rows; fp8 36,864 B + 256 B of per-layer scales ->
    # (8,589,934,592 - 256) // 36,864 = 233,016 rows
    rows = _rows(out)
    assert list(rows) == ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4",
                          "fp4_mx_block16"]
    assert rows["fp32"] == ["147,456", "58,253", "0.50x", "14", "8.00"]
    assert rows["bf16"] == ["73,728", "116,507", "1.00x", "28", "8.00"]
    assert rows["fp8_e4m3"] == ["36,864", "233,015", "2.00x", "56", "8.00"]
    assert rows["nvfp4"] == rows["fp4_mx_block16"] == ["-"] * 5
    for d in ("nvfp4", "fp4_mx_block16"):
        assert f"{d}: not sized: LayoutError: {FP4_MSG.format(d)}" in out
        assert f"dtype: {d}," not in out  # no SGLang line for a pool that cannot exist
    assert "dtype: bf16, #tokens: 116507," in out


def test_size_all_json_has_an_error_entry(tmp_path, capsys):
    model = _llama_head_dim_72(tmp_path)
    rc = main(["size", model, "--total-memory", "16", "--weights", "0",
               "--mem-fraction-static", "0.5", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and [d["dtype"] for d in data] == list(kvpool.KV_DTYPES)
    by = {d["dtype"]: d for d in data}
    assert by["fp8_e4m3"]["num_tokens"] == 233_015 and "error" not in by["fp8_e4m3"]
    assert by["bf16"]["requests_fit"] == 116_507 // 8192 == 14
    assert by["nvfp4"] == {"dtype": "nvfp4", "model": model, "context_len": 8192,
                           "error": FP4_MSG.format("nvfp4"), "error_type": "LayoutError"}


def test_size_one_dtype_that_cannot_be_laid_out_still_fails(tmp_path, capsys):
    model = _llama_head_dim_72(tmp_path)
    for extra in ([], ["--json"]):
        rc = main(["size", model, "--kv-cache-dtype", "nvfp4", "--total-memory", "16",
                   "--weights", "0", *extra])
        captured = capsys.readouterr()
        assert rc == 2 and captured.out == ""
        assert f"error: LayoutError: {FP4_MSG.format('nvfp4')}" in captured.err


def test_size_all_a_budget_too_small_for_one_dtype(capsys):
    """A budget that holds bf16 pages but not fp32 ones: fp32 is named, the rest are sized."""
    # 0.0004 GiB = round(429,496.73) = 429,497 B, mem_frac 1, no weights: all of it is budget.
    # fp32 needs 2 rows x 32 x 2 x 8 x 128 x 4 B = 524,288 B, 94,791 more; bf16 131,072 B/token:
    # 3 rows, 2 tokens
    rc = main(["size", "meta-llama/Llama-3.1-8B", "--total-memory", "0.0004", "--weights", "0",
               "--mem-fraction-static", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert _rows(out)["fp32"] == ["-"] * 5
    assert _rows(out)["bf16"][:2] == ["131,072", "2"]
    assert ("fp32: not sized: BudgetTooSmallError: budget of 429497 bytes cannot hold one page"
            in out)
    assert "needs 524288 bytes, 94791 more" in out


def test_size_all_fails_when_no_dtype_fits(capsys):
    # 0.00005 GiB = 53,687 B: below even FP4's 2 rows x 36,864 B; the first dtype's error (fp32)
    rc = main(["size", "meta-llama/Llama-3.1-8B", "--total-memory", "0.00005", "--weights", "0",
               "--mem-fraction-static", "1"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert "BudgetTooSmallError: budget of 53687 bytes" in captured.err
    assert "262144 bytes per token" in captured.err


def test_size_all_with_a_recipe_only_one_dtype_cannot_take(capsys):
    """The bundled Qwen3-8B (36 layers, 8 KV heads of 128) with `--nvfp4-recipe page_major` at
    page size 1: only nvfp4 has page-major scales (page_size % 4 != 0), the rest are sized."""
    rc = main(["size", "Qwen/Qwen3-8B", "--nvfp4-recipe", "page_major", "--total-memory", "16",
               "--weights", "0", "--mem-fraction-static", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = _rows(out)
    assert rows["nvfp4"] == ["-"] * 5
    assert ("nvfp4: not sized: LayoutError: nvfp4 recipe `page_major` (page-major scales) needs "
            "page_size % 4 == 0 and head_dim % 64 == 0; got page_size = 1, head_dim = 128") in out
    # fp4_mx_block16: 36 x 2 x 8 x (64 B of data + 8 UE8M0 scales) = 41,472 B/token, no fixed
    # bytes: 8 GiB // 41,472 = 207,126 rows -> 207,125 tokens
    assert rows["fp4_mx_block16"][:2] == ["41,472", "207,125"]


def _gguf_str(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def _gguf_file(path, kv: list[bytes], tensors: list[bytes] = ()):
    """A GGUF v3 file from raw metadata entries, after a llama architecture and the three
    geometry fields, and raw tensor infos."""
    kv = [
        _gguf_str("general.architecture") + struct.pack("<I", 8) + _gguf_str("llama"),
        _gguf_str("llama.block_count") + struct.pack("<II", 4, 2),
        _gguf_str("llama.embedding_length") + struct.pack("<II", 4, 64),
        _gguf_str("llama.attention.head_count") + struct.pack("<II", 4, 4),
        *kv,
    ]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    path.write_bytes(head + b"".join(kv) + b"".join(tensors) + b"\0" * 64)
    return str(path)


def _nested(depth: int) -> bytes:
    inner = struct.pack("<IQ", 4, 0)
    for _ in range(depth):
        inner = struct.pack("<IQ", 9, 1) + inner
    return struct.pack("<I", 9) + inner


# Malformed GGUF files found by the API attack: each printed a traceback and exited 1
# (ZeroDivisionError, a ValueError naming nothing, RecursionError, IndexError, TypeError).
@pytest.mark.parametrize("kv, tensors, text", [
    ([_gguf_str("general.alignment") + struct.pack("<II", 4, 0)], [],
     "`general.alignment` must be a power of two in 1..2^31, got 0"),
    ([_gguf_str("general.alignment") + struct.pack("<I", 8) + _gguf_str("abc")], [],
     "`general.alignment` must be an unsigned integer, got 'abc'"),
    ([_gguf_str("evil.nest") + _nested(5000)], [], "`evil.nest` nests arrays more than 16 deep"),
    ([], [_gguf_str("token_embd.weight") + struct.pack("<IQIQ", 1, 8, 0, 0)],
     "tensor `token_embd.weight` has shape [8]"),
    ([_gguf_str("llama.attention.head_count_kv") + struct.pack("<IIQ", 9, 9, 2)
      + struct.pack("<IQII", 4, 2, 2, 2) + struct.pack("<IQI", 4, 1, 2)], [],
     "`llama.attention.head_count_kv` must be a value or an array of one value per layer"),
])
def test_cli_malformed_gguf_exit_2(kv, tensors, text, tmp_path, capsys):
    model = _gguf_file(tmp_path / "bad.gguf", kv, tensors)
    rc = main(["size", model, "--total-memory", "16", "--weights", "0"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("error: ModelConfigError: ") and model in err and text in err


def test_cli_model_path_with_brackets(tmp_path, capsys):
    """A path holding `[/x]` went to rich as markup: MarkupError and a traceback."""
    d = tmp_path / "a[" / "b]"  # the path reads `.../a[/b]/...`
    d.mkdir(parents=True)
    bad = [_gguf_str("general.alignment") + struct.pack("<II", 4, 0)]
    model = _gguf_file(d / "m[red].gguf", bad)
    assert main(["size", model, "--total-memory", "16", "--weights", "0"]) == 2
    assert model in capsys.readouterr().err
    model = _gguf_file(d / "ok.gguf", [])
    assert main(["size", model, "--total-memory", "16", "--weights", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"{model}: 2 layers")
