"""A newcomer's path (issue 21): version, the CLI in the CLI's terms, the capacity picture,
and a missing torch or matplotlib that says which extra to install."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool._cli_errors import for_cli
from kvpool.cli import main

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / "python")
GIB = 1 << 30


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.setenv("NO_COLOR", "1")


def _pyproject_version():
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^\[project\][^\[]*?^version = "([^"]+)"', text, re.M | re.S).group(1)


# ------------------------------------------------------------------ version
def test_version_matches_pyproject():
    assert kvpool.__version__ == _pyproject_version()


def test_version_fallback_without_metadata():
    from kvpool import _version

    assert _version._pyproject_version() == _pyproject_version()


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpool {kvpool.__version__}"


# ------------------------------------------------------------------ CLI wording
def _err(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    return " ".join(cap.err.split())  # rich may wrap


def test_no_memory_figures_names_flags_and_gib(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine measures its device instead")
    err = _err(capsys, ["size", "Qwen/Qwen3-8B"])
    assert "`--gpu`" in err and "`--total-memory`" in err and "in GiB" in err
    assert "gpu=" not in err and "total_memory" not in err and "in bytes" not in err


def test_mem_fraction_error_names_the_flag(capsys):
    err = _err(capsys, ["size", "Qwen/Qwen3-8B", "--gpu", "H200", "--mem-fraction-static", "1.5"])
    assert "`--mem-fraction-static` must be in (0, 1], got 1.5" in err
    assert "mem_frac" not in err


def test_memory_error_in_gib(capsys):
    err = _err(capsys, ["size", "Qwen/Qwen3-8B", "--total-memory", "10",
                        "--available-memory", "20"])  # fmt: skip
    # 20 GiB = 21,474,836,480 bytes and 10 GiB = 10,737,418,240 bytes, printed as GiB
    assert "available memory (20.00 GiB) exceeds total memory (10.00 GiB)" in err
    assert "21474836480" not in err and "`--available-memory`" in err


def test_budget_too_small_in_gib_bytes_per_token_kept(capsys):
    err = _err(capsys, ["size", "Qwen/Qwen3-8B", "--gpu", "L4", "--kv-cache-dtype", "bf16",
                        "--page-size", "100000"])  # fmt: skip
    # one page of 100,000 tokens + the padding page at 147,456 B/token = 29,491,200,000 bytes
    assert f"needs {2 * 100000 * 147456 / GIB:.2f} GiB" in err
    assert "147456 bytes per token" in err and "`--page-size`" in err


def test_for_cli_keeps_small_byte_counts_and_prose():
    assert for_cli("a page of 4096 bytes") == "a page of 4096 bytes"
    assert for_cli("raise `tp_size` or use a larger GPU") == "raise `--tp-size` or use a larger GPU"
    assert for_cli("weights of 3221225472 bytes") == "weights of 3.00 GiB"
    assert for_cli("the weights are big") == "the weights are big"


def test_unknown_model_points_to_kvpool_models(capsys):
    err = _err(capsys, ["size", "/no/such/model", "--gpu", "H200"])
    assert "`kvpool models`" in err
    assert "Qwen/Qwen3-8B" not in err and "openai/gpt-oss-20b" not in err


def test_sglang_line_says_what_it_is(capsys):
    assert main(["size", "Qwen/Qwen3-8B", "--gpu", "H200"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "KV Cache is allocated" in x]
    assert len(lines) == len(kvpool.KV_DTYPES)
    assert all(x.startswith("SGLang would log: KV Cache is allocated. dtype: ") for x in lines)


def test_help_states_units(capsys):
    with pytest.raises(SystemExit):
        main(["size", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--total-memory GIB", "--available-memory GIB", "--weights GIB|auto"):
        assert flag in out
    assert out.count("in GiB") >= 3 and "--plot FILE.png" in out


# ------------------------------------------------------------------ the capacity picture
def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    f = tmp_path / "cap.png"
    assert main(["size", "Qwen/Qwen3-8B", "--gpu", "H200", "--plot", str(f)]) == 0
    assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 10_000
    assert "SGLang would log" in capsys.readouterr().out  # the text report still prints


def test_requests_by_fraction_is_size_for():
    from kvpool.plot import MEM_FRACTIONS, requests_by_fraction

    spec = kvpool.ModelSpec.from_pretrained("Qwen/Qwen3-8B")
    pts = requests_by_fraction(spec, "fp8_e4m3", 8192, {"gpu": "H200", "mem_frac": 0.9})
    assert [f for f, _ in pts] == list(MEM_FRACTIONS)
    for f, n in pts:
        assert n == kvpool.size_for(spec, "fp8_e4m3", f, gpu="H200").requests_fit(8192)
    assert [n for _, n in pts] == sorted(n for _, n in pts)


def test_readme_shows_the_committed_picture():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"!\[[^\]]*\]\((docs/img/[^)]+\.png)\)", readme)
    assert m and (ROOT / m.group(1)).read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ missing optional deps
_BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {mods!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""


def _run_without(mods, code):
    env = dict(os.environ, PYTHONPATH=PYTHON, NO_COLOR="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-c", _BLOCK.format(mods=set(mods)) + code],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip


@pytest.mark.parametrize("stmt", [
    "import kvpool; kvpool.KVPool",
    "import kvpool.attention",
    "import kvpool.write",
    "from kvpool.pool import KVPool",
])  # fmt: skip
def test_missing_torch_names_the_extra(stmt):
    code = f"""
try:
    {stmt}
except ImportError as e:
    print('ERR', type(e).__name__, e)
"""
    r = _run_without({"torch", "triton"}, code)
    assert r.returncode == 0, r.stderr
    assert "ERR ImportError" in r.stdout and "pip install 'kvpool[torch]'" in r.stdout


def test_sizing_needs_no_torch():
    r = _run_without({"torch", "triton"}, "import kvpool; print(kvpool.size_for("
                     "'Qwen/Qwen3-8B', 'bf16', 0.9, gpu='H200').num_tokens)")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == kvpool.size_for("Qwen/Qwen3-8B", "bf16", 0.9, gpu="H200").num_tokens


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    code = ("import sys; from kvpool.cli import main; "
            f"sys.exit(main(['size', 'Qwen/Qwen3-8B', '--gpu', 'H200', '--plot', r'{tmp_path}/x.png']))")  # fmt: skip
    r = _run_without({"matplotlib"}, code)
    assert r.returncode == 2
    assert "pip install 'kvpool[plot]'" in " ".join(r.stderr.split())
    assert not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------ point 9
def test_cli_requests_column_is_requests_fit_and_docstrings_say_so(capsys):
    # gpt-oss-20b alternates sliding (window 128) and full layers: the two counts differ
    plan = kvpool.size_for("openai/gpt-oss-20b", "bf16", 0.9, gpu="H200")
    assert main(["size", "openai/gpt-oss-20b", "--gpu", "H200", "--kv-cache-dtype", "bf16"]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("│ bf16"))
    assert row.split("│")[5].strip() == f"{plan.requests_fit(8192):,}"
    # layer groups: the pool holds what request_bytes counts (sliding layers windowed), so the
    # printed count really fits, and the docstring says it is the CLI's column
    assert plan.requests_fit(8192) * plan.request_bytes(8192) <= plan.budget_bytes
    assert "kvpool size" in kvpool.Plan.requests_fit.__doc__


def test_test_stages_say_what_they_deselect_and_readme_warns_of_cuda_wheels():
    stages = (ROOT / "scripts" / "test").read_text()
    last_echo = [x for x in stages.splitlines() if x.startswith("echo ")][-1]
    assert "GPU and slow tests deselected" in last_echo and "-m gpu" in last_echo
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "CUDA wheels, about 3 GB" in readme
