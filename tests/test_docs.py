"""The README and the benchmark pages hold together:
- every path they point at exists (markdown links, and repository paths or `python -m benchmarks.*`
  modules in code spans: results move between folders; a stale path is found here, not by a reader);
- every figure of the README's performance section is in benchmarks/STATUS.md (at most 100 lines),
  whose every `bash benchmarks/run.sh` command names a recipe or a module that exists, with flags
  it declares;
- benchmarks/NOTES.md is a dated journal: each entry's heading starts with its date, oldest first."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from benchmarks.paths import module_file
from benchmarks.recipes import RECIPES

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


STATUS = ROOT / "benchmarks" / "STATUS.md"
NOTES = ROOT / "benchmarks" / "NOTES.md"
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def figures(text: str) -> set[str]:
    """The numbers of a text, commas dropped ("6,293" and "6293" are one figure); paths, commits and
    commands in code spans are not figures."""
    prose = re.sub(r"`[^`\n]*`", " ", text)
    return {m.replace(",", "") for m in NUMBER.findall(prose)}


def performance_section(readme: str) -> str:
    start = readme.index("\n## Performance")
    return readme[start : readme.index("\n## ", start + 1)]


def test_every_readme_performance_figure_is_in_status():
    section = performance_section((ROOT / "README.md").read_text())
    missing = sorted(figures(section) - figures(STATUS.read_text()), key=float)
    assert "6293" in figures(section)  # the section is found and holds the headline rows
    assert not missing, f"README performance figures missing from benchmarks/STATUS.md: {missing}"


def test_status_is_one_page():
    assert len(STATUS.read_text().splitlines()) <= 100


RUNNER_OPTIONS = ("--budget-s", "--out", "--label", "--xla-flags", "--set")


def runner_commands(text: str) -> list[tuple[list[str], str, list[str]]]:
    """(runner options, target, target arguments) of every `bash benchmarks/run.sh ...` code span."""
    commands = []
    for span in re.findall(r"`bash benchmarks/run\.sh ([^`]+)`", text):
        words, options = shlex.split(span), []
        while words[0] in RUNNER_OPTIONS:
            options, words = options + words[:2], words[2:]
        commands.append((options, words[0], words[1:]))
    return commands


def test_every_status_command_runs_a_recipe_or_module_that_exists():
    commands = runner_commands(STATUS.read_text())
    assert len(commands) >= 5
    for options, target, args in commands:
        words = options + args
        settings = [value.split("=")[0] for flag, value in zip(words, words[1:]) if flag == "--set"]
        if target in RECIPES:
            assert set(settings) <= RECIPES[target].variables.keys(), (target, settings)
            assert len(args) == 2 * len([a for a in args if a == "--set"]), (target, args)
            continue
        source = module_file(target).read_text()
        undeclared = [a for a in args if a.startswith("--") and f'"{a}"' not in source]
        assert not settings and not undeclared, (target, settings, undeclared)


def test_notes_is_a_dated_journal_oldest_first():
    headings = re.findall(r"^## (.*)$", NOTES.read_text(), flags=re.M)
    dates = [re.match(r"(\d{4}-\d{2}-\d{2}): ", h) for h in headings]
    assert headings and all(dates), [h for h, d in zip(headings, dates) if not d]
    assert [d.group(1) for d in dates] == sorted(d.group(1) for d in dates)
