"""examples/serve.py as a newcomer reads it (issue 21, point 6): every flag explained with its
default, progress on the long parts, and the pool calls of a step in the example's own
ModelRunner, which gives the logits kvpool.llama.Llama.forward gives."""

import argparse
import inspect

import numpy as np
import pytest
import torch
from kvpool import fidelity
from llama_fixtures import EXAMPLES, tiny_llama

serve = pytest.importorskip("serve", reason=f"examples/serve.py not importable from {EXAMPLES}")


def test_every_flag_has_help_and_shows_its_default():
    p = serve.parser()
    assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    opts = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
    assert len(opts) >= 16
    for a in opts:
        assert a.help and a.help.strip(), a.option_strings
    text = " ".join(p.format_help().split())
    assert text.count("(default:") == len(opts)
    assert "(default: 1024)" in text and "(default: auto)" in text


def test_runner_shows_the_pool_calls():
    src = inspect.getsource(serve.ModelRunner.run)
    for call in ("pool.write(layer,", "pool.decode", "pool.extend", "m.qkv(", "m.finish_layer("):
        assert call in src


@pytest.mark.parametrize("page_size", [1, 4])
def test_runner_matches_llama_forward(page_size):
    model = tiny_llama(seed=3)
    ids = torch.tensor(np.random.default_rng(0).integers(0, 97, 21).tolist())
    pages = np.arange(1, 64 // page_size + 1, dtype=np.int32)
    got, want = [], []
    for use_runner, out in ((True, got), (False, want)):
        pool = fidelity.pool_for(model, "auto", 64, page_size=page_size)
        runner = serve.ModelRunner(model, pool)
        # prefill 13 tokens, then decode the rest one by one
        chunks = [(0, 13)] + [(t, 1) for t in range(13, 21)]
        for start, n in chunks:
            step = runner.prepare([pages], [start], [n])
            x = ids[start : start + n]
            out.append(runner.run(x, step) if use_runner else model.forward(pool, x, step))
    assert torch.equal(torch.cat(got), torch.cat(want))


def test_engine_reports_progress_per_step():
    model = tiny_llama(seed=1)
    pool = serve.make_pool(model, "auto", 256, 4)
    eng = serve.Engine(model, pool, max_running=2)
    for i in range(3):
        eng.submit(list(range(3 + i, 12 + i)), 4)
    seen = []
    eng.run(on_step=lambda e: seen.append(sum(r.done for r in e.requests)))
    assert len(seen) == eng.stats.steps and seen[-1] == 3 and seen == sorted(seen)


def test_progress_goes_to_stderr(capsys):
    with serve.progress() as bar:
        t = bar.add_task("work", total=2)
        bar.advance(t, 2)
    assert capsys.readouterr().out == ""
