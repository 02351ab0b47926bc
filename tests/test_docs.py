"""Every ```python block of the docs runs as written (on the CPU; GPU blocks only on CUDA).

Blocks of one page run in order in one namespace, a fresh one per page, so a page reads as one
program. A block preceded by ``<!-- gpu -->`` needs CUDA and is skipped without it; one preceded by
``<!-- redis -->`` starts a redis-server and is skipped only when none is installed; in README.md
only blocks preceded by ``<!-- runnable -->`` run (its other blocks show output or elided code).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# an optional HTML comment marker line, then a fenced python block
BLOCK = re.compile(
    r"(?:^<!--\s*(?P<mark>[\w-]+)\s*-->\n)?^```python\n(?P<code>.*?)^```", re.S | re.M
)


def blocks(page: Path) -> list[tuple[int, str | None, str]]:
    """(line number, marker, code) of each python block of ``page``."""
    text = page.read_text()
    found = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        found.append((line, m.group("mark"), m.group("code")))
    return found


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def runnable(page: Path, mark: str | None) -> bool:
    if page.name == "README.md":
        return mark == "runnable"
    return True


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_blocks_run(page: Path) -> None:
    ns: dict = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for line, mark, code in blocks(page):
        if not runnable(page, mark):
            continue
        if mark == "gpu" and not _cuda():
            continue
        if mark == "redis" and shutil.which("redis-server") is None:
            continue
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), ns)
        except Exception as e:  # name the block: the traceback's file is page:line
            where = f"{page.relative_to(ROOT)} block at line {line}"
            raise AssertionError(f"{where} failed: {e!r}") from e
        ran += 1
    if page.name != "README.md":
        assert ran > 0 or not blocks(page), f"{page.name}: no block ran"


def test_every_docs_page_has_its_blocks_collected() -> None:
    # the regex must see every fence: a ```python the pattern misses would go untested
    for page in PAGES:
        fences = len(re.findall(r"^```python$", page.read_text(), re.M))
        assert fences == len(blocks(page)), page.name


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "README.md"], ids=lambda p: p.name)
def test_gpu_blocks_are_marked_and_nothing_else_needs_cuda(page: Path) -> None:
    for line, mark, code in blocks(page):
        if mark != "gpu":
            assert '"cuda"' not in code and "'cuda'" not in code, (
                f"{page.name}:{line} uses CUDA but is not marked <!-- gpu -->"
            )


# --- paths the docs cite exist ------------------------------------------------------------------

CITING = [
    "README.md",
    "CONTRIBUTING.md",
    "docs/*.md",
    "benches/*/README.md",
    "benches/attention/RESULTS.md",
    "benches/write/NOTES.md",
    "benches/e2e/results/README.md",
    "benches/radix/results/radix_replay.md",
    "python/kvpool/**/*.py",
    "triton_kernels/*.py",
]
# a backticked path (one slash at least) to a file with a known suffix or to a folder; bare file
# names are left out (tables name files of a folder given in their header)
_PATH = re.compile(
    r"`([\w.{},*-]*/[\w.{},*/-]*(?:\.(?:py|md|json|txt|log|sh|png|rs|toml|yml|tgz)|/))`"
)


def _expand(token: str) -> list[str]:
    """Brace expansion (``run{5,6}_h200``; ``a..b`` ranges of the radix notes as a glob)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m:
        alts = m.group(1).split(",")
        return [x for alt in alts for x in _expand(token.replace(m.group(0), alt, 1))]
    return [re.sub(r"\d+\.\.\d+|\.\.", "*", token)]


# bench notes also name result files bare (`radix_replay_set2_run1..9.json`) or unquoted in tables
_BARE = re.compile(r"`([A-Za-z][\w.{},*-]*\.(?:json|txt|log|tgz))`")
_UNQUOTED = re.compile(r"(?<![\w/`])(results/[\w.{},*/-]+\.(?:json|txt|log|md))")


def cited_paths() -> list[tuple[str, str]]:
    out = []
    for pattern in CITING:
        for page in sorted(ROOT.glob(pattern)):
            text = page.read_text()
            tokens = _PATH.findall(text) + _UNQUOTED.findall(text)
            if page.relative_to(ROOT).parts[0] == "benches":
                tokens += _BARE.findall(text)
            for token in tokens:
                if token.startswith(("http", "/", "~")) or token in ("config.json",):
                    continue
                out.append((str(page.relative_to(ROOT)), token))
    return out


_BENCHES = sorted(p for p in (ROOT / "benches").iterdir() if p.is_dir())


def _exists(page: Path, token: str) -> bool:
    bases = [ROOT, page.parent, *page.parents]
    rel = page.relative_to(ROOT).parts
    # bench notes name files of their runs' folders; code cites them from its own bench
    benches = [ROOT / "benches" / rel[1]] if rel[0] == "benches" else _BENCHES
    for bench in benches:
        bases += [bench, bench / "results", *(bench / "results").glob("**/")]
    for path in _expand(token):
        if not any(list(b.glob(path.rstrip("/"))) for b in bases):
            return False
    return True


def test_cited_paths_exist() -> None:
    found = cited_paths()
    assert len(found) > 50, "the path pattern no longer finds the docs' citations"
    missing = [f"{page}: `{tok}`" for page, tok in found if not _exists(ROOT / page, tok)]
    assert not missing, "cited but missing:\n" + "\n".join(missing)


# --- nothing refers outside the repository ------------------------------------------------------

OUTSIDE = re.compile(r"\.\./shared/|\bshared/(?:DESIGN|CASES|STYLE)|\bDESIGN\.md|\bCASES\.md")
# Files of other branches whose references are replaced when those branches land (listed in the
# docs branch's report); remove each entry with its fix. The docs, README, CONTRIBUTING, the
# example, the bench notes and the tests are clean already.
PENDING: set[str] = set()


def _tracked_text_files() -> list[Path]:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.suffix not in (".png", ".tgz", ".so", ".gguf") and p.is_file()]


def test_no_reference_outside_the_repository() -> None:
    hits = []
    for path in _tracked_text_files():
        rel = str(path.relative_to(ROOT))
        if rel in PENDING or rel == "tests/test_docs.py":
            continue
        text = path.read_text(errors="replace")
        for m in OUTSIDE.finditer(text):
            hits.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not hits, "references to files a clone does not have:\n" + "\n".join(hits)
