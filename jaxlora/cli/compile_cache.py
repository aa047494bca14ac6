"""JAX's persistent compilation cache, on by default for the `jaxlora` command.

Start-up is mostly warm-up, and warm-up is mostly XLA compiles (on a 2-core CPU, SmolLM2's compiles
were ~90% of the time to first token). With the cache a second start of the same command with the
same model and engine shapes reads the compiled executables back instead of compiling them.

Where it lives, in order:
  1. the `--compilation-cache` flag of the engine's commands, then `$JAXLORA_COMPILATION_CACHE`: a
     folder, or `off` to run without the cache;
  2. `$JAX_COMPILATION_CACHE_DIR` (JAX's own setting), if set;
  3. `$XDG_CACHE_HOME/jaxlora/jax`, else `~/.cache/jaxlora/jax`.

Only the command line turns it on (library code never changes JAX's global configuration), and it
must happen before the first compile: JAX decides once per process whether a cache is in use.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "JAXLORA_COMPILATION_CACHE"
OFF = "off"
# Cache every compile: on CPU most warm-up shapes compile in under JAX's default threshold (1 s)
# each, yet together they are most of the start-up.
MIN_COMPILE_SECONDS = 0.0


def cache_dir(environ: dict[str, str] | None = None, flag: str | None = None) -> Path | None:
    """The folder the command line caches compiles in, or None when turned off. `flag`: the
    `--compilation-cache` value, which wins over the environment."""
    environ = os.environ if environ is None else environ
    chosen = (flag if flag is not None else environ.get(ENV, "")).strip()
    if chosen.lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxlora" / "jax"


def enable(environ: dict[str, str] | None = None, flag: str | None = None) -> Path | None:
    """Turns the cache on for this process (see the module docstring); returns its folder or None.

    A folder that cannot be created turns the cache off with a warning: the command still runs,
    only without the faster second start.
    """
    folder = cache_dir(environ, flag)
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        import sys

        print(
            f"jaxlora: compilation cache off ({folder}: {e.strerror}); set --compilation-cache or {ENV} to a writable folder or to '{OFF}'",
            file=sys.stderr,
        )
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder
