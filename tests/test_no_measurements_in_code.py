"""Numbers live in results and tuning tables, not in product code.

Product code (jaxlora/, pallas_kernels/, serving/, configs/*.yaml) states a rule and links its
decision record, `benchmarks/DECISIONS.md#<anchor>`; the timings that justify the rule and the
results folders they came from are written there. This checks that no product line quotes a
measurement (a number with a unit of time, bandwidth, throughput or speed-up) or names a results or
probe folder, and that every DECISIONS.md link points at a heading that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DECISIONS = ROOT / "benchmarks" / "DECISIONS.md"
PRODUCT = sorted(
    [p for top in ("jaxlora", "pallas_kernels", "serving") for p in (ROOT / top).rglob("*.py")]
    + list((ROOT / "configs").glob("*.yaml"))
)

# A figure with a unit: "4.8 ms", "7.2 / 10.7 us", "1.1-1.3 TB/s", "1.46x slower", "28.66 req/s".
# Unit names without a figure ("ms per step", `timeout_ms`) and sizes or factors ("13.5 GB", "within
# 2x", "8 x 8 tile") are not measurements of a run.
MEASUREMENT = re.compile(
    r"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?\s?"
    r"(?:ms|us|µs|ns|[KMGT]B/s|TFLOP/?s|req/s|tok/s|tokens/s|x (?:faster|slower))(?![\w/])"
)
# Where a measurement came from: a results folder, or a one-off probe's name ("mgpu_probe",
# "probe_s11b"), or the phrase that quotes one.
SOURCE = re.compile(r"results/|\w+_probe\b|\bprobe_s\d+\w*|\bmeasured on (?:the|an?) H[12]00\b")
LINK = re.compile(r"benchmarks/DECISIONS\.md#([\w-]+)")


def offences(text: str) -> list[str]:
    """The lines of `text` that quote a measurement or name a results or probe folder."""
    return [line.strip() for line in text.splitlines() if MEASUREMENT.search(line) or SOURCE.search(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)}


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_product_file_quotes_no_measurement(path):
    found = offences(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} quotes measurements (move them to benchmarks/DECISIONS.md): {found}"


def test_every_decision_link_has_its_heading():
    known = anchors(DECISIONS.read_text())
    links = {(p.relative_to(ROOT), a) for p in PRODUCT for a in LINK.findall(p.read_text())}
    assert links, "product code links no decision"
    missing = sorted((str(p), a) for p, a in links if a not in known)
    assert not missing, f"links to headings DECISIONS.md does not have: {missing}"


def test_the_checker_tells_measurements_from_units():
    assert offences("# 11.3 ms scanned vs 4.8 ms unrolled") and offences("# expand 7.1 / 9.4 us at 16")
    assert offences("streams at 1.1-1.3 TB/s") and offences("ran 1.46x slower") and offences("28.67 req/s")
    assert offences("(benchmarks/results/archive/x/)") and offences("see mgpu_probe") and offences("probe_s11b/g")
    assert offences("measured on the H200: the host blocked")
    assert not offences("timeout_ms: int = 100  # ms per step, 2x the budget, an 8 x 8 tile, 13.5 GB")
    assert not offences("with socket.socket() as probe:  # load balancers can probe")
    assert not offences("see benchmarks/DECISIONS.md#gemm-backend")


def test_slugs_follow_github():
    assert slug("W8A8: min tokens (fp8, int8)") == "w8a8-min-tokens-fp8-int8"
    assert slug("quant-kernel-choice") == "quant-kernel-choice"
    assert anchors("# Title\n## lora_group rule\ntext ## not a heading") == {"title", "lora_group-rule"}
