"""The `jaxlora` subcommand this package adds: pyproject.toml declares it as an entry point of the
group `jaxlora.commands`, which `jaxlora.cli.main` reads (jaxlora itself never imports benchmarks)."""

from jaxlora.cli.subcommand import Subcommand

BENCH = Subcommand(module="benchmarks.engine.e2e", help="end-to-end throughput benchmark")
