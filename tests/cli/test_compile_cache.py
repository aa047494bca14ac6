"""Where the command line keeps JAX's persistent compilation cache (the batch-job tests check that a
second start reads it back instead of compiling)."""

from pathlib import Path

from jaxlora.cli.compile_cache import cache_dir


def test_cache_folder_follows_the_environment(tmp_path):
    assert cache_dir({"JAXLORA_COMPILATION_CACHE": "off", "JAX_COMPILATION_CACHE_DIR": "/jax"}) is None
    assert cache_dir({"JAXLORA_COMPILATION_CACHE": "OFF"}) is None
    assert cache_dir({"JAXLORA_COMPILATION_CACHE": str(tmp_path)}) == tmp_path
    assert cache_dir({"JAX_COMPILATION_CACHE_DIR": "/jax"}) == Path("/jax")
    assert cache_dir({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/jaxlora/jax")
    assert cache_dir({}) == Path.home() / ".cache" / "jaxlora" / "jax"


def test_the_flag_wins_over_the_environment(tmp_path):
    assert cache_dir({"JAXLORA_COMPILATION_CACHE": "/env"}, flag="off") is None
    assert cache_dir({"JAXLORA_COMPILATION_CACHE": "off"}, flag=str(tmp_path)) == tmp_path
    assert cache_dir({"JAXLORA_COMPILATION_CACHE": "/env"}, flag=None) == Path("/env")
