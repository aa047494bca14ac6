"""`jaxlora` command line: one subcommand per job; each lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Modules expose add_args(parser) and run(args) -> exit code.
# Imported lazily so `jaxlora --help` does not pay for JAX start-up.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("jaxlora.cli.generate", "generate text for a prompt or a JSONL batch, with adapters"),
    "demo": ("jaxlora.cli.demo", "one mixed batch: the base model and every demo adapter side by side"),
    "convert": ("jaxlora.cli.convert", "convert a GGUF or Hugging Face model to a fast orbax checkpoint"),
    "merge": ("jaxlora.cli.merge", "merge a PEFT adapter into the base model, write an HF folder"),
    "train": ("jaxlora.cli.train", "train a LoRA adapter with optax, saved in PEFT format"),
    "serve": ("jaxlora.cli.serve", "serve over gRPC and the OpenAI-compatible HTTP API"),
    "client": ("jaxlora.cli.client", "send a prompt to a running gRPC server"),
    "bench": ("jaxlora.cli.bench", "end-to-end throughput benchmark"),
}


# Subcommands that never compile (no persistent compilation cache to set up).
_NO_COMPILES = frozenset({"client"})


class UsageParser(argparse.ArgumentParser):
    """Prints a usage error as one line (argparse prints the whole usage first) and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = UsageParser(prog="jaxlora", description="Multi-LoRA LLM serving in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_args(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    if args.command not in _NO_COMPILES:
        from jaxlora.cli import compile_cache

        compile_cache.enable()
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
