import json
import subprocess
import sys

import pytest

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
    (["--total-memory", "16", "--page-size", "99999999999999999999"], "page_size"),
    (["--total-memory", "16", "--context-len", "0"], "context-len"),
    # found by the user review of 2026-11-29: these printed the SGLang lines before failing
    # (context), or said ">= 0" for a page size whose minimum is 1
    (["--total-memory", "16", "--context-len", str(1 << 64)], "--context-len must be in"),
    (["--total-memory", "16", "--page-size", "-1"], "`page_size` must be >= 1, got -1"),
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
