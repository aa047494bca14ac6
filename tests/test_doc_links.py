"""Every path the README and the benchmark pages point at exists: markdown links, and repository
paths or `python -m benchmarks.*` modules written in code spans (results move between folders;
a stale path is found here, not by a reader)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "benchmarks").glob("*.md"))]
TOP = ("benchmarks", "configs", "checkpoints", "jaxlora", "pallas_kernels", "serving", "scripts", "tests")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r"|results)/[\w./*{},-]*)")
MODULE = re.compile(r"-m (benchmarks(?:\.[a-z_0-9]+)+)(?!\w)")


def expand(braced: str) -> list[str]:
    """`a.{md,json}` -> [`a.md`, `a.json`] (shell brace expansion, as the pages write file sets)."""
    parts = re.split(r"\{([^}]*)\}", braced)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def resolves(path: str, page: Path) -> bool:
    bases = [page.parent, ROOT] if path.startswith("results/") or not path.startswith(TOP) else [ROOT]
    for base, one in itertools.product(bases, expand(path.rstrip(".,:;"))):
        if "*" in one and any(base.glob(one.rstrip("/"))) or (base / one).exists():
            return True
    return False


def referenced(page: Path) -> list[str]:
    text = page.read_text()
    paths = [m for m in LINK.findall(text) if "://" not in m and not m.startswith("mailto:")]
    for span in SPAN.findall(text):
        if "<" in span or "$" in span or "NAME" in span or "..." in span:
            continue  # a placeholder, not a path
        paths += PATH.findall(span)
    return paths


def module_exists(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_on_the_page_exists(page):
    missing = sorted({p for p in referenced(page) if not resolves(p, page)})
    assert not missing, f"{page.name} points at paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_benchmark_module_on_the_page_exists(page):
    missing = sorted({m for m in MODULE.findall(page.read_text()) if not module_exists(m)})
    assert not missing, f"{page.name} runs modules that do not exist: {missing}"


def test_the_checker_finds_a_stale_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see `benchmarks/results/no_such_probe/` and [x](no/such/file.md)")
    assert sorted(referenced(page)) == ["benchmarks/results/no_such_probe/", "no/such/file.md"]
    assert not any(resolves(p, page) for p in referenced(page))
    assert module_exists("benchmarks.serving.trace") and not module_exists("benchmarks.serving.nothing")
