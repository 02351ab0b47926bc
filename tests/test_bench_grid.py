"""benches/attention/bench_grid.py (issue 17's benchmark grid) on the CPU: the grid read from the
bundled configs, balanced shards that cover it once, the --quick run end to end (torch path),
resuming, the memory guard, the FlashInfer guard, and grid_report.py's markdown and plot."""

import json
import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benches", "attention"))

import bench_grid  # noqa: E402
import grid_report  # noqa: E402
from kvpool.config import bundled_models  # noqa: E402


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # --quick: the torch path


def _by_label():
    return {lab: lay for lay in bench_grid.grid() for _, lab in lay.models}


def test_grid_covers_every_bundled_model_per_rank():
    lays = bench_grid.grid()
    hubs = {hub for lay in lays for hub, _ in lay.models}
    assert hubs == set(bundled_models())
    g = _by_label()
    # per-rank geometry from the configs: (tp, query heads, KV heads, head_dim, options)
    want = {
        "deepseek-v3": (1, 128, 0, 576, {}),
        "deepseek-v3-tp8": (8, 16, 0, 576, {}),
        "deepseek-r1": (1, 128, 0, 576, {}),
        "kimi-k2": (1, 64, 0, 576, {}),
        "kimi-k2-tp8": (8, 8, 0, 576, {}),
        "llama-3.1-70b": (8, 8, 1, 128, {}),
        "mixtral-8x7b": (2, 16, 4, 128, {}),
        "qwen3-next-80b": (4, 4, 1, 256, {}),
        "qwen3.5-27b": (1, 24, 4, 256, {}),
        "gemma-2-9b": (1, 16, 8, 256, {"softcap": 50.0}),
        "gemma-2-9b-sliding": (1, 16, 8, 256, {"softcap": 50.0, "window": 4096}),
        "gpt-oss-20b-sliding": (1, 64, 8, 64, {"sinks": True, "window": 128}),
        "qwen2.5-vl-7b": (1, 28, 4, 128, {}),
    }
    for lab, (tp, hq, hk, d, opts) in want.items():
        lay = g[lab]
        assert (lay.tp, lay.hq, lay.hk, lay.d, lay.opts) == (tp, hq, hk, d, opts), lab
    assert g["deepseek-v3"].rank == 512
    # models sharing a per-rank layer are timed once
    assert g["deepseek-r1"] is g["deepseek-v3"] and g["deepseek-v3"].label == "deepseek-v3"
    assert g["llama-3.1-8b-instruct"] is g["qwen3-8b"] is g["llama-3.1-8b"]
    assert len(lays) == 16


def test_shards_cover_the_grid_once_and_balance():
    args = (("bf16", "nvfp4"), bench_grid.SHAPES, False)
    lays = bench_grid.grid()
    parts = [bench_grid.shard(lays, i, 2, *args) for i in range(2)]
    labels = [x.label for p in parts for x in p]
    assert sorted(labels) == sorted(x.label for x in lays) and len(set(labels)) == len(labels)
    est = [bench_grid.estimate_s(p, *args) for p in parts]
    assert abs(est[0] - est[1]) <= max(bench_grid.estimate_s([x], *args) for x in lays)
    # FlashInfer's JIT modules are counted once per (head_dim, dtype, variant), not per layer
    fi = bench_grid.estimate_s(lays, *args[:2], True) - bench_grid.estimate_s(lays, *args)
    mods = {bench_grid.fi_module(x, "bf16") for x in lays}
    assert fi == pytest.approx(
        len(mods) * bench_grid.EST_FI_JIT_S
        + sum(len(bench_grid.pages_of(x)) for x in lays) * 4 * bench_grid.EST_FI_POINT_S
    )


def test_dry_run_lists_points_and_refuses_unknown_models(capsys):
    out = bench_grid.main(["--dry-run", "--models", "kimi-k2-tp8,gpt-oss-20b", "--dtypes", "bf16"])
    assert [(r["label"], r["points"]) for r in out] == [("kimi-k2-tp8", 8), ("gpt-oss-120b", 4)]
    assert "12 timed points" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown --models"):
        bench_grid.main(["--dry-run", "--models", "llama-9"])


def test_quick_run_resumes_and_reports(tmp_path):
    out = str(tmp_path / "run")
    argv = ["--quick", "--out", out, "--models", "deepseek-v3-tp8,gemma-2-9b-sliding",
            "--dtypes", "bf16,nvfp4"]  # fmt: skip
    # a budget of 0 starts no point; the next run does them all
    assert bench_grid.main([*argv, "--budget-s", "0"]) == []
    recs = bench_grid.main([*argv, "--flashinfer"])
    # deepseek (2 models) x 2 dtypes x 2 pages x 2 shapes + gemma sliding 2 x 2
    assert len(recs) == 16 + 4 and not [r for r in recs if "error" in r]
    keys = {bench_grid.rec_key(r) for r in recs}
    assert len(keys) == len(recs)
    r1 = [r for r in recs if r["model"] == "deepseek-r1-tp8"]
    assert len(r1) == 8 and all(r["measured_as"] == "deepseek-v3-tp8" for r in r1)
    mla = [r for r in recs if r["layer"] == "mla"]
    assert len(mla) == 16  # the two deepseek models' records (else the next line is vacuous)
    assert all(r["kernel"] == "mla_small" and r["tflops"] > 0 for r in mla)  # (<= 32 heads)
    assert all(r["ratio"] == pytest.approx(r["baseline_ms"] / r["time_ms"]) for r in recs)
    assert {r["baseline"] for r in recs} == {"torch_mla_bf16", "sdpa_bf16"}
    # FlashInfer cannot run here: one record says why, the grid went on
    with open(os.path.join(out, "flashinfer.json")) as f:
        fi = json.load(f)
    assert fi == [{"model": "*", "error": "flashinfer needs CUDA (--quick runs on the CPU)"}]
    # resumed: nothing new
    assert len(bench_grid.main(argv)) == 20
    # the report: a section of RESULTS.md between markers (rewritten, not appended), a plot
    md = tmp_path / "RESULTS.md"
    md.write_text("# kept\n")
    for _ in range(2):
        text = grid_report.main([out, "--md", str(md), "--title", "cpu smoke"])
    body = md.read_text()
    assert body.startswith("# kept\n") and body.count(grid_report.BEGIN) == 1
    assert "| deepseek-v3-tp8 | 8 | mla | 2/MLA x 48 | nvfp4 | mla_small |" in text
    assert "### MLA, page 64" in text and "deepseek-r1-tp8 = deepseek-v3-tp8" in text
    assert (tmp_path / "run" / "models.png").stat().st_size > 10_000


def test_memory_guard_records_skips(tmp_path):
    recs = bench_grid.main(["--quick", "--out", str(tmp_path), "--models", "qwen3.5-27b",
                            "--dtypes", "bf16", "--mem-gib", "0.1"])  # fmt: skip
    assert len(recs) == 2 and all("time_ms" not in r for r in recs)
    assert all(r["skipped"].startswith("needs 0.") and "> --mem-gib 0.1" in r["skipped"]
               for r in recs)  # fmt: skip
