"""Weight files in safetensors format, written with the mode every other file gets.

safetensors' `save_file` writes a private temporary file and renames it into place, so the result
has mode 0600 whatever the umask says: merged models and trained adapters came out readable by
their owner only, next to config files that were 0644.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def save_safetensors(
    tensors: Mapping[str, np.ndarray], path: str | Path, *, metadata: dict[str, str] | None = None
) -> None:
    """`save_file`, then the mode a plain `open(path, "w")` would give: the umask's for a new file,
    the old mode for a file that was there."""
    path = Path(path)
    with open(path, "ab"):  # creates the file as open() does, or leaves an existing one as it is
        pass
    mode = stat.S_IMODE(path.stat().st_mode)
    save_file(dict(tensors), str(path), metadata=metadata)
    os.chmod(path, mode)
