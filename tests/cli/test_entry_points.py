"""The subcommands other packages add to `jaxlora` (entry points of `jaxlora.commands`): what
pyproject.toml declares is what the installed metadata holds, and each names a runnable Subcommand."""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

from jaxlora.cli.main import COMMANDS_GROUP, SUBCOMMANDS, all_subcommands
from jaxlora.cli.subcommand import Subcommand

ROOT = Path(__file__).resolve().parents[2]


def declared() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"][COMMANDS_GROUP]


def test_the_installed_metadata_holds_the_declared_entry_points():
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group=COMMANDS_GROUP)}
    assert installed == declared(), "the installed jaxlora is stale: run `pip install -e .` again"


def test_every_declared_entry_point_is_a_runnable_subcommand():
    assert set(declared()) == {"serve", "client", "bench"}
    for name, value in declared().items():
        module, _, attribute = value.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, Subcommand) and name not in SUBCOMMANDS
        runner = importlib.import_module(command.module)
        assert callable(runner.add_args) and callable(runner.run)
    assert not all_subcommands()["client"].compiles and all_subcommands()["serve"].compiles
