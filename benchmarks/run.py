"""The device runner: one benchmark module or one named recipe (benchmarks/recipes.py) under one wall
clock, each part in its own process under `timeout`, the log filtered of XLA's noise, and every part's
output in its benchmark's dated run folder.

    benchmarks/run.sh --list                                    # the recipes and what they run
    benchmarks/run.sh [--budget-s 560] [--out DIR] [--label L] RECIPE [--set name=value ...]
    benchmarks/run.sh [--budget-s 560] [--out DIR] [--label L] [--xla-flags F] GROUP.NAME [args...]

A part of benchmark GROUP.NAME writes to `DIR/GROUP/NAME/runs/<date>-<label>[-<part>]/` (DIR defaults
to benchmarks/results, so a device call given `--out $OUT` brings back a tree that merges into it):
the benchmark's own files, `log.txt` (its filtered output) and `run.json` (command, XLA_FLAGS,
timeout, exit status, wall time, commit). A module run gets `--out <that folder>` appended unless its
arguments name `--out`. Promote a run to the benchmark's latest results by copying its files up to
`results/GROUP/NAME/`. Standard library only: no JAX in this process.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.paths import RESULTS, ROOT, benchmark_name, module_file
from benchmarks.recipes import RECIPES, Part, Recipe

NOISE = re.compile(r"hlo_rematerialization|cuda_timer|^WARNING|Deprecation")
ENV_DEFAULTS = {
    "PYTHONUNBUFFERED": "1",
    "TQDM_DISABLE": "1",
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
PLACEHOLDER = re.compile(r"\{(\w+)\}")
# Benchmarks whose --out names a file, not a folder.
OUT_FILES = {"engine.hf_peer": "hf_peer.json"}


@dataclasses.dataclass(frozen=True)
class Clock:
    total_s: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left_s(self) -> float:
        return self.total_s - (time.monotonic() - self.start)


def module_recipe(module: str, args: list[str], xla_flags: str | None, total_s: int) -> Recipe:
    """A one-part recipe for `GROUP.NAME args...`, its output folder appended as --out."""
    if not module_file(module).exists():
        raise SystemExit(f"no benchmark {module!r}: {module_file(module)} does not exist (see --list)")
    if "--out" not in args:
        args = [*args, "--out", "{out}/" + OUT_FILES[module] if module in OUT_FILES else "{out}"]
    return Recipe(doc=module, total_s=total_s, parts=(Part(module=module, args=shlex.join(args), xla_flags=xla_flags),))


def fill(arg: str, values: dict[str, str]) -> list[str]:
    """Fills `{name}` placeholders; an argument that is one placeholder splits on spaces (lists)."""
    missing = set(PLACEHOLDER.findall(arg)) - values.keys()
    if missing:
        raise SystemExit(f"{arg!r} needs {sorted(missing)}: set them with --set name=value")
    whole = PLACEHOLDER.fullmatch(arg)
    if whole:
        return values[whole.group(1)].split()
    return [PLACEHOLDER.sub(lambda m: values[m.group(1)], arg)]


def run_folder(root: Path, part: Part, label: str, day: str) -> Path:
    """root/GROUP/NAME/runs/<day>-<label>[-<part label>], suffixed with the time if it exists."""
    name = "-".join(x for x in (day, label, part.label) if x)
    folder = root / benchmark_name(part.module) / "runs" / name
    if folder.exists():
        folder = folder.with_name(f"{name}-{datetime.datetime.now():%H%M%S}")
    return folder


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def say(line: str, log) -> None:
    print(line, flush=True)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def stream(command: list[str], env: dict[str, str], drop: re.Pattern[str] | None, log) -> int:
    """Runs `command`, writing its filtered output to stdout and the log; returns the exit status."""
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            line = line.rstrip("\n")
            if not NOISE.search(line) and not (drop and drop.search(line)):
                say(line, log)
    return p.returncode


def part_timeout_s(part: Part, left_s: float) -> int:
    seconds = int((int(left_s) - part.reserve_s) * part.share)
    return min(seconds, part.cap_s) if part.cap_s is not None else seconds


def part_command(part: Part, folder: Path, timeout_s: int, variables: dict[str, str]) -> list[str]:
    """`python -m benchmarks.<module> args...` with the part's placeholders filled."""
    values = {**variables, "out": str(folder), "budget_s": str(timeout_s - part.margin_s)}
    return ["python", "-m", f"benchmarks.{part.module}", *(a for word in part.words for a in fill(word, values))]


def run_part(part: Part, folder: Path, timeout_s: int, variables: dict[str, str], commit: str | None) -> int:
    shown = part_command(part, folder, timeout_s, variables)
    command = ["timeout", "--kill-after=10", str(timeout_s), sys.executable, *shown[1:]]
    env = {**ENV_DEFAULTS, **os.environ, "PYTHONPATH": str(ROOT)}
    if part.xla_flags is not None:
        env["XLA_FLAGS"] = part.xla_flags
    folder.mkdir(parents=True, exist_ok=True)
    drop = re.compile("|".join(part.drop)) if part.drop else None
    started, t0 = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), time.monotonic()
    with open(folder / "log.txt", "a") as log:
        flags = "inherited" if part.xla_flags is None else repr(part.xla_flags)
        say(f"== {part.module} {part.label} (XLA_FLAGS {flags}, timeout {timeout_s} s) -> {folder}", log)
        say("   " + " ".join(shown), log)
        returncode = stream(command, env, drop, log)
        wall_s = round(time.monotonic() - t0, 1)
        say(f"== {part.module} {part.label}: exit {returncode} after {wall_s} s", log)
    record = {"module": part.module, "label": part.label, "command": shown, "xla_flags": part.xla_flags}
    record |= {"timeout_s": timeout_s, "returncode": returncode, "wall_s": wall_s, "started": started, "commit": commit}
    (folder / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return returncode


def gpu_header() -> None:
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem"
        subprocess.run(["nvidia-smi", query, "--format=csv"], check=False)


def run(recipe: Recipe, root: Path, label: str, variables: dict[str, str], dry_run: bool) -> int:
    clock, day, commit = Clock(recipe.total_s), f"{datetime.date.today():%Y-%m-%d}", git_commit()
    if not dry_run:
        gpu_header()
    failed = 0
    for part in recipe.parts:
        timeout_s = part_timeout_s(part, clock.left_s() if not dry_run else recipe.total_s)
        if timeout_s < part.min_s:
            print(f"== {part.module} {part.label}: not run ({int(clock.left_s())} s left)", flush=True)
            continue
        folder = run_folder(root, part, label, day)
        if dry_run:  # each part's timeout as if it started the run
            command = " ".join(part_command(part, folder, timeout_s, variables))
            print(f"XLA_FLAGS={part.xla_flags!r} timeout {timeout_s} {command}")
            continue
        failed += run_part(part, folder, timeout_s, variables, commit) != 0
    print(f"== done at {recipe.total_s - int(clock.left_s())} s, {failed} part(s) failed", flush=True)
    return 1 if failed else 0


def list_recipes() -> None:
    for name, recipe in RECIPES.items():
        modules = ", ".join(dict.fromkeys(p.module for p in recipe.parts))
        print(f"{name:14s} {recipe.total_s:4d} s  {modules}\n{'':20s}{recipe.doc}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--list", action="store_true", help="list the recipes and exit")
    p.add_argument(
        "--budget-s", type=int, default=None, help="wall clock for the whole run (default: the recipe's, or 560)"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="root of the results tree (default: benchmarks/results)")
    p.add_argument("--label", default=None, help="run folder label (default: the recipe's name, or 'run')")
    p.add_argument("--xla-flags", default=None, help="XLA_FLAGS for a module run (recipes set their own)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a recipe variable")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("target", nargs="?", help="a recipe name or a benchmark module GROUP.NAME")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for a module run")
    return p.parse_args(argv)


def recipe_settings(recipe_name: str, recipe: Recipe, words: list[str]) -> dict[str, str]:
    """`--set name=value` pairs (before or after the recipe's name) checked against its variables."""
    pairs = argparse.ArgumentParser(prog=f"run.sh {recipe_name}", add_help=False)
    pairs.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    settings, rest = pairs.parse_known_args(words)
    if rest or any("=" not in s for s in settings.set):
        raise SystemExit(f"recipe {recipe_name!r} takes only --set name=value, not {rest or settings.set}")
    values = dict(s.split("=", 1) for s in settings.set)
    unknown = values.keys() - recipe.variables.keys()
    if unknown:
        raise SystemExit(
            f"recipe {recipe_name!r} has no variables {sorted(unknown)}; it has {sorted(recipe.variables)}"
        )
    return {**recipe.variables, **values}


def resolve(args: argparse.Namespace) -> tuple[Recipe, str, dict[str, str]]:
    if args.target in RECIPES:
        recipe = RECIPES[args.target]
        if args.xla_flags is not None:
            raise SystemExit(f"recipe {args.target!r} sets XLA_FLAGS per part; --xla-flags is for a module run")
        variables = recipe_settings(args.target, recipe, [w for s in args.set for w in ("--set", s)] + list(args.args))
        if args.budget_s is not None:
            recipe = dataclasses.replace(recipe, total_s=args.budget_s)
        return recipe, args.label or args.target, variables
    if args.set:
        raise SystemExit("--set names a recipe's variables; a module run takes the module's own arguments")
    recipe = module_recipe(args.target, list(args.args), args.xla_flags, args.budget_s or 560)
    return recipe, args.label or "run", {}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list or not args.target:
        list_recipes()
        return 0
    recipe, label, variables = resolve(args)
    return run(recipe, args.out.resolve(), label, variables, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
