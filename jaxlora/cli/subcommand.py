"""`Subcommand`: how `jaxlora.cli.main` finds a subcommand, its own or one an entry point adds.

A module of its own (no imports beyond the standard library) so that packages adding subcommands
import it cheaply, and get the same class when `jaxlora.cli.main` runs as `__main__`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Subcommand:
    """One `jaxlora` subcommand.

    Attributes:
      module: dotted name of a module exposing add_args(parser) and run(args) -> exit code; imported
        only when its subcommand runs, so `jaxlora --help` does not pay for JAX start-up.
      help: one line for `jaxlora --help`.
      compiles: False for a subcommand that never compiles (no persistent compilation cache is set up).
      unavailable: why it cannot run in this installation (None: it can); running it prints this and
        exits 2.
    """

    module: str
    help: str
    compiles: bool = True
    unavailable: str | None = None
