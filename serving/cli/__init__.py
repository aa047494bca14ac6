"""The `jaxlora` subcommands this package adds: pyproject.toml declares them as entry points of the
group `jaxlora.commands`, which `jaxlora.cli.main` reads (jaxlora itself never imports serving)."""

from jaxlora.cli.subcommand import Subcommand

SERVE = Subcommand(module="serving.cli.serve", help="serve over gRPC and the OpenAI-compatible HTTP API")
CLIENT = Subcommand(module="serving.cli.client", help="send a prompt to a running gRPC server", compiles=False)
