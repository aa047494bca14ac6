"""`jaxlora` command line: one subcommand per job; each lives in its own module.

jaxlora's own subcommands are listed here. Other packages of the distribution add theirs through
entry points of the group `jaxlora.commands` (pyproject.toml), each naming a `Subcommand`:
`serving` adds `serve` and `client`, `benchmarks` adds `bench`. So this package never imports
them, and the dependencies still point one way (serving -> jaxlora, benchmarks -> jaxlora).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import time

from jaxlora.cli.subcommand import Subcommand

_STARTED = time.perf_counter()  # the start-up line's "import" phase counts from here (stdlib imports only before)

COMMANDS_GROUP = "jaxlora.commands"


SUBCOMMANDS: dict[str, Subcommand] = {
    "generate": Subcommand(
        module="jaxlora.cli.generate", help="generate text for a prompt or a JSONL batch, with adapters"
    ),
    "demo": Subcommand(
        module="jaxlora.cli.demo", help="one mixed batch: the base model and every demo adapter side by side"
    ),
    "convert": Subcommand(
        module="jaxlora.cli.convert", help="convert a GGUF or Hugging Face model to a fast orbax checkpoint"
    ),
    "merge": Subcommand(
        module="jaxlora.cli.merge", help="merge a PEFT adapter into the base model, write an HF folder"
    ),
    "train": Subcommand(module="jaxlora.cli.train", help="train a LoRA adapter with optax, saved in PEFT format"),
}


def all_subcommands() -> dict[str, Subcommand]:
    """SUBCOMMANDS plus those the installed entry points of `COMMANDS_GROUP` add.

    An entry point whose package this installation lacks (the wheel does not install `benchmarks`)
    becomes an unavailable subcommand that says so. Raises RuntimeError for an entry point that names
    no Subcommand or reuses a taken name.
    """
    commands = dict(SUBCOMMANDS)
    for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP):
        try:
            command = entry.load()
        except ModuleNotFoundError as e:
            if e.name != entry.module.split(".")[0]:
                raise  # the package is there and something it imports is not: a real error
            command = missing_package(entry, e.name)
        if not isinstance(command, Subcommand):
            raise RuntimeError(f"entry point {entry.name} = {entry.value} ({COMMANDS_GROUP}) is not a Subcommand")
        if entry.name in commands:
            raise RuntimeError(f"entry point {entry.name} = {entry.value} reuses the subcommand name {entry.name!r}")
        commands[entry.name] = command
    return commands


def missing_package(entry: importlib.metadata.EntryPoint, package: str) -> Subcommand:
    """The stand-in for a subcommand whose package is not installed here."""
    why = (
        f"`jaxlora {entry.name}` comes from {entry.value}, and this installation has no {package!r} package: "
        f"it ships only with a source checkout of jaxlora. Run `python -m jaxlora.cli.main {entry.name} ...` "
        "from the checkout's root (its folders are importable from there)."
    )
    return Subcommand(module=entry.module, help=f"(needs a source checkout: no {package!r} here)", unavailable=why)


class UsageParser(argparse.ArgumentParser):
    """Prints a usage error as one line (argparse prints the whole usage first) and exits 2. Flags
    are never abbreviated: `--max-lora 4` is an error, not `--max-lora-rank 4`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help line, unless the line already says it or there is
    none to show (a flag off by default, a default decided elsewhere)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], {}, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = all_subcommands()
    top_help = argv[:1] in (["-h"], ["--help"])
    parser = UsageParser(
        prog="jaxlora",
        description="Multi-LoRA LLM serving in JAX.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=UsageParser)
    chosen = argv[0] if argv and argv[0] in commands else None
    for name, command in commands.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if name == chosen and command.unavailable:
            parser.exit(2, f"jaxlora: error: {command.unavailable}\n")
        if (name == chosen or top_help) and not command.unavailable:
            mod = importlib.import_module(command.module)
            mod.add_args(p)
            p.set_defaults(_run=mod.run)
    if top_help:
        parser.epilog = _flags_of_each(sub.choices)
    args = parser.parse_args(argv)
    args.started = _STARTED
    args.compilation_cache_dir = None
    if commands[args.command].compiles:
        from jaxlora.cli import compile_cache

        args.compilation_cache_dir = compile_cache.enable(flag=getattr(args, "compilation_cache", None))
    return int(args._run(args) or 0)


def _flags_of_each(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """`jaxlora --help`'s list of every subcommand's flags (`jaxlora COMMAND --help` explains them)."""
    lines = ["flags of each command (jaxlora COMMAND --help for what they do and their defaults):"]
    for name, p in parsers.items():
        flags = [" | ".join(a.option_strings) for a in p._actions if a.option_strings and a.dest != "help"]
        lines.append(f"  {name}: " + ", ".join(flags))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
