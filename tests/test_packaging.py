"""What the wheel installs (pyproject.toml and setup.py say why): `jaxlora`, `pallas_kernels` and
`serving` under the names the code imports, the demo adapters as package data, never `benchmarks` or
`tests`; and a `jaxlora` subcommand whose package is not installed says how to run it instead of
breaking the command line."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jaxlora.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "build", "dist", "*.egg-info", "results", ".cache")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src, out = tmp_path_factory.mktemp("src") / "jaxlora", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, src, ignore=SKIP)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    (path,) = out.glob("jaxlora-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_the_three_packages_and_not_benchmarks_or_tests(wheel):
    top = {n.split("/")[0] for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"jaxlora", "pallas_kernels", "serving"}


def test_the_demo_adapters_ship_as_package_data(wheel):
    names = set(wheel.namelist())
    for adapter in ("shout", "json", "pirate"):
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            assert f"jaxlora/demo_adapters/{adapter}/{file}" in names
            size = wheel.getinfo(f"jaxlora/demo_adapters/{adapter}/{file}").file_size
            assert size == (ROOT / "checkpoints" / "demo" / adapter / file).stat().st_size


def test_the_installed_names_are_this_distributions_alone():
    owners = importlib.metadata.packages_distributions()
    for name in ("jaxlora", "pallas_kernels", "serving"):
        assert set(owners.get(name, ["jaxlora"])) == {"jaxlora"}, (name, owners[name])


def _entry(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=cli.COMMANDS_GROUP)


def test_a_subcommand_whose_package_is_missing_says_to_use_a_checkout(monkeypatch, capsys):
    entries = [_entry("bench", "no_such_package_here.commands:BENCH")]
    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda group: entries)
    assert cli.all_subcommands()["bench"].unavailable
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--tiny"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no_such_package_here" in err and "python -m jaxlora.cli.main bench" in err


def test_a_broken_import_inside_an_installed_package_is_not_hidden(monkeypatch):
    # The package exists (jaxlora) but the module it names does not: an error, not "unavailable".
    entries = [_entry("bench", "jaxlora.no_such_module:BENCH")]
    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda group: entries)
    with pytest.raises(ModuleNotFoundError):
        cli.all_subcommands()
