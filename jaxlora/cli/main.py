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

    Raises RuntimeError for an entry point that names no Subcommand or reuses a taken name.
    """
    commands = dict(SUBCOMMANDS)
    for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP):
        command = entry.load()
        if not isinstance(command, Subcommand):
            raise RuntimeError(f"entry point {entry.name} = {entry.value} ({COMMANDS_GROUP}) is not a Subcommand")
        if entry.name in commands:
            raise RuntimeError(f"entry point {entry.name} = {entry.value} reuses the subcommand name {entry.name!r}")
        commands[entry.name] = command
    return commands


class UsageParser(argparse.ArgumentParser):
    """Prints a usage error as one line (argparse prints the whole usage first) and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = all_subcommands()
    parser = UsageParser(prog="jaxlora", description="Multi-LoRA LLM serving in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in commands else None
    for name, command in commands.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if name == chosen:
            mod = importlib.import_module(command.module)
            mod.add_args(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    args.started = _STARTED
    args.compilation_cache_dir = None
    if commands[args.command].compiles:
        from jaxlora.cli import compile_cache

        args.compilation_cache_dir = compile_cache.enable(flag=getattr(args, "compilation_cache", None))
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
