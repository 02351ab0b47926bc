"""examples/serve.py --cuda-graph on CPU: the graph engine (its decode steps on DecodeGraph's
static buffers, eagerly here) serves the same tokens as the eager Engine, through admission,
eviction and retraction; the running batch's page table is kept in place (kvpool.running,
checked against a plain Python model of the requests); the flag's default and fallback."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvpool import page_table
from kvpool.running import RunningBatch
from llama_fixtures import EXAMPLES, tiny_llama

serve = pytest.importorskip("serve", reason=f"examples/serve.py not importable from {EXAMPLES}")


def _serve(engine_cls, pool_tokens, **kw):
    model = tiny_llama(seed=2)
    pool = serve.make_pool(model, "auto", pool_tokens, 4)
    eng = engine_cls(model, pool, max_running=5, **kw)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 97, 10).tolist()
    reqs = []
    for i in range(9):
        prompt = (shared if i % 3 else []) + rng.integers(3, 97, int(rng.integers(2, 14))).tolist()
        reqs.append(eng.submit(prompt, int(rng.integers(3, 12)), arrival=i // 3))
    eng.run(cancel_after={4: 2})
    return eng, [(r.status, r.output) for r in reqs]


@pytest.mark.parametrize("pool_tokens", [512, 48])
def test_graph_engine_serves_the_same_tokens_as_the_eager_engine(pool_tokens):
    eager, want = _serve(serve.Engine, pool_tokens)
    graph, got = _serve(serve.GraphEngine, pool_tokens, use_graphs=False, max_seq_len=64)
    assert got == want
    # not vacuous: request 4 was cancelled after 2 tokens, the other eight ran to their end
    assert [st for st, _ in want] == ["finished"] * 4 + ["cancelled"] + ["finished"] * 4
    assert len(want[4][1]) == 2 and all(len(out) >= 3 for st, out in want if st == "finished")
    assert graph.stats.generated == eager.stats.generated
    if pool_tokens == 48:  # the tight pool evicts and retracts in both
        assert graph.stats.evicted_pages > 0 and graph.stats.retracted > 0
        assert eager.stats.retracted > 0
    assert graph.batch.n == 0 and graph.rows == []
    assert graph.allocator.num_used == graph.cache.total_size // 4  # only cached pages left


def test_graph_engine_rejects_what_its_page_table_cannot_hold():
    model = tiny_llama(seed=2)
    eng = serve.GraphEngine(model, serve.make_pool(model, "auto", 256, 4), use_graphs=False,
                            max_seq_len=32, max_running=2)  # fmt: skip
    r = eng.submit(list(range(3, 30)), 8)
    assert r.status == "rejected" and "32 tokens" in r.error and "--graph-max-len" in r.error
    ok = eng.submit(list(range(3, 20)), 8)
    eng.run()
    assert ok.status == "finished" and len(ok.output) == 8


def test_cuda_graph_flag_default_and_cpu_fallback(capsys):
    p = serve.parser()
    assert p.parse_args([]).cuda_graph is None
    assert p.parse_args(["--cuda-graph"]).cuda_graph is True
    assert p.parse_args(["--no-cuda-graph"]).cuda_graph is False
    assert serve.cuda_graph_mode(p.parse_args(["--device", "cuda"])) is True
    assert serve.cuda_graph_mode(p.parse_args([])) is False
    assert serve.cuda_graph_mode(p.parse_args(["--device", "cuda", "--no-cuda-graph"])) is False
    assert capsys.readouterr().err == ""
    assert serve.cuda_graph_mode(p.parse_args(["--cuda-graph"])) is True  # CPU: eager steps
    assert "run eagerly" in capsys.readouterr().err


class RunningBatchModel(RuleBasedStateMachine):
    """RunningBatch against a list of requests (pages, seq_len, next id) in row order."""

    PS, ROWS, WIDTH = 4, 6, 5

    def __init__(self):
        super().__init__()
        self.rb = RunningBatch(self.ROWS, self.WIDTH, self.PS)
        self.model: list[list] = []  # [pages, seq_len, next_id] per row
        self.next_page = 1

    def _pages(self, k):
        p = list(range(self.next_page, self.next_page + k))
        self.next_page += k
        return np.asarray(p, np.int32)

    @precondition(lambda self: len(self.model) < self.ROWS)
    @rule(cached=st.integers(0, 12), tok=st.integers(0, 99))
    def add(self, cached, tok):
        pages = self._pages(-(-cached // self.PS))
        assert self.rb.add(pages, cached + 1, tok) == len(self.model)
        self.model.append([list(pages), cached + 1, tok])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        row = data.draw(st.integers(0, len(self.model) - 1))
        moved = self.rb.remove(row)
        last = self.model.pop()
        if row < len(self.model):
            assert moved == len(self.model)
            self.model[row] = last
        else:
            assert moved is None

    @rule(toks=st.lists(st.integers(0, 99), min_size=6, max_size=6))
    def step(self, toks):
        n = len(self.model)
        need = [m for m in self.model if len(m[0]) * self.PS < m[1]]
        if any(len(m[0]) + 1 > self.WIDTH for m in need):
            before = self.next_page
            with pytest.raises(ValueError, match="`max_pages` = 5"):
                self.rb.grow(self._pages)
            assert self.next_page == before  # (alloc not called; the invariant: nothing written)
            return
        rows, pages = self.rb.grow(self._pages)
        want_rows = [i for i, m in enumerate(self.model) if len(m[0]) * self.PS < m[1]]
        assert rows.tolist() == want_rows
        for i, p in zip(want_rows, pages.tolist(), strict=True):
            self.model[i][0].append(p)
        slots = self.rb.slots()
        for i, m in enumerate(self.model):
            pos = m[1] - 1
            assert slots[i] == m[0][pos // self.PS] * self.PS + pos % self.PS
        self.rb.advance(np.asarray(toks[:n]))
        for i, m in enumerate(self.model):
            m[1] += 1
            m[2] = toks[i]

    @invariant()
    def same_arrays(self):
        n = len(self.model)
        assert self.rb.n == n
        if n:
            want = page_table([np.asarray(m[0], np.int32) for m in self.model], self.WIDTH)
            assert np.array_equal(self.rb.table[:n], want)  # as a full rebuild makes it
        assert self.rb.seq_lens[:n].tolist() == [m[1] for m in self.model]
        assert self.rb.next_ids[:n].tolist() == [m[2] for m in self.model]


TestRunningBatch = RunningBatchModel.TestCase


def test_running_batch_grow_refuses_a_bad_alloc_and_writes_nothing():
    rb = RunningBatch(2, 3, 4)
    rb.add(np.array([5], np.int32), 5, 0)  # (4 cached on page 5: the 5th needs a page)
    rb.add(np.array([6], np.int32), 3, 0)
    table, num = rb.table.copy(), rb.num_pages.copy()

    def boom(k):
        raise MemoryError(f"no {k} pages")

    for alloc, err, match in (
        (boom, MemoryError, "no 1 pages"),
        (lambda k: np.arange(1, 3, dtype=np.int32), ValueError, "`new_pages` has 2 entries"),
        (lambda k: np.zeros(k, np.int32), ValueError, "page 0 is the padding page"),
        (lambda k: [9] * k, None, None),  # (a list is taken as int32)
    ):
        if err is None:
            rows, pages = rb.grow(alloc)
            assert rows.tolist() == [0] and pages.tolist() == [9]
            assert rb.table[0].tolist() == [5, 9, 0] and rb.num_pages[:2].tolist() == [2, 1]
            break
        with pytest.raises(err, match=match):
            rb.grow(alloc)
        assert np.array_equal(rb.table, table) and np.array_equal(rb.num_pages, num)
    # no row short: alloc is not called
    assert [x.tolist() for x in rb.grow(boom)] == [[], []]


def test_grow_pages_checks_everything_before_alloc_runs():
    from kvpool._core import grow_pages

    calls = []

    def alloc(k):
        calls.append(k)
        return np.arange(20, 20 + k, dtype=np.int32)

    table = np.array([[7, 0], [8, 0]], np.int32)
    num, seq = np.array([1, 1], np.int32), np.array([17, 5], np.int32)
    with pytest.raises(ValueError, match="`num_pages` has 1 entries, expected 2"):
        grow_pages(table, num[:1], seq[:1], 16, alloc)
    ro = table.copy()
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="page_table"):
        grow_pages(ro, num, seq, 16, alloc)
    assert calls == []  # (alloc's pages would have been lost)

    def meddle(k):  # changes the batch under the call
        num[1] = 0
        return alloc(k)

    with pytest.raises(RuntimeError, match="changed while `alloc` ran"):
        grow_pages(table, num, seq, 16, meddle)
    assert table.tolist() == [[7, 0], [8, 0]]
    num[1] = 1
    rows, pages = grow_pages(table, num, seq, 16, alloc)
    assert (rows.tolist(), pages.tolist(), table.tolist()) == ([0], [20], [[7, 20], [8, 0]])


def test_running_batch_refuses_bad_rows():
    rb = RunningBatch(1, 2, 4)
    with pytest.raises(ValueError, match="do not fit"):
        rb.add(np.arange(1, 4, dtype=np.int32), 5, 0)
    with pytest.raises(ValueError, match="seq_len"):
        rb.add(np.arange(1, 2, dtype=np.int32), 9, 0)  # 8 cached tokens on one page of 4
    rb.add(np.arange(1, 2, dtype=np.int32), 4, 0)
    with pytest.raises(ValueError, match="full"):
        rb.add(np.arange(1, 2, dtype=np.int32), 4, 0)
    with pytest.raises(IndexError, match="row 1"):
        rb.remove(1)
    with pytest.raises(ValueError, match="max_rows"):
        RunningBatch(0, 2, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_graph_engine_replays_equal_its_eager_steps_gpu(kv_dtype):
    """On CUDA: the captured decode graphs give the tokens the same steps give eagerly on the
    same buffers (same buckets, rows and kernels), through eviction and retraction."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvpool.config import ModelSpec
    from kvpool.llama import Llama
    from llama_fixtures import TINY, tiny_weights

    spec = ModelSpec.from_dict(TINY, name="tiny", dtype="bf16")
    model = Llama(TINY, tiny_weights(seed=2), spec, "cuda")
    runs = []
    for graphs in (True, False):
        pool = serve.make_pool(model, kv_dtype, 96, 4, scales=([1.0] * spec.num_layers,) * 2)
        eng = serve.GraphEngine(model, pool, max_running=5, use_graphs=graphs, max_seq_len=64)
        assert bool(eng.graph.graphs) == graphs
        rng = np.random.default_rng(0)
        reqs = [eng.submit(rng.integers(3, 97, int(rng.integers(2, 20))).tolist(), 10,
                           arrival=i // 3) for i in range(9)]  # fmt: skip
        eng.run()
        runs.append([(r.status, r.output) for r in reqs])
    assert runs[0] == runs[1]
