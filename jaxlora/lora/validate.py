"""Checks shared by every way an adapter enters the engine (folder load, gRPC Load, CLI flags)."""

from __future__ import annotations

import re

import numpy as np

from jaxlora.errors import AdapterError

# The largest magnitude an adapter weight may have once its scale is folded in (A, and B times
# lora_alpha / r). Trained adapters stay far below it: the demo adapters' largest is 0.09, PEFT
# initializes A at about 1/sqrt(in_features) and B at zero. Weights near it would push activations
# past float32's range within a few layers, and the request would decode NaN logits into empty text.
MAX_ADAPTER_WEIGHT = 1e3

# Said wherever an adapter's rank is refused: the bank's rank is fixed at start-up.
RANK_HINT = "the bank's largest rank; start with a larger --max-lora-rank (engine config: lora.max_rank)"

# Names travel in requests, metrics labels and file names: keep them to a safe alphabet.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_adapter_name(name: object) -> str:
    """Returns `name` if it is a usable adapter name, else raises AdapterError saying why.

    A name is 1-128 characters from `A-Z a-z 0-9 . _ -`, and not "." or ".." (it may become a path).
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise AdapterError(
            f"adapter name {name!r} is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - (not '.' or '..')"
        )
    return name


def _extremes(weights: np.ndarray) -> tuple[float, float]:
    # max and min read the array once each and allocate nothing; either is NaN if any entry is.
    return float(weights.max(initial=-np.inf)), float(weights.min(initial=np.inf))


def weights_within_bound(weights: np.ndarray) -> bool:
    """Whether every entry of `weights` is finite and at most MAX_ADAPTER_WEIGHT in magnitude."""
    hi, lo = _extremes(weights)
    return -MAX_ADAPTER_WEIGHT <= lo and hi <= MAX_ADAPTER_WEIGHT  # False for NaN


def check_weight_magnitude(where: str, weights: np.ndarray) -> None:
    """Raises AdapterError unless every entry of `weights` (an adapter's A, or B with its scale
    folded in) is finite and at most MAX_ADAPTER_WEIGHT in magnitude; `where` names the tensor."""
    hi, lo = _extremes(weights)
    if weights.size and not (np.isfinite(hi) and np.isfinite(lo)):
        raise AdapterError(f"{where}: contains NaN or Inf values")
    largest = max(hi, -lo, 0.0)
    if largest > MAX_ADAPTER_WEIGHT:
        raise AdapterError(
            f"{where}: holds a weight of magnitude {largest:.3g} (scale folded in), above the "
            f"bound {MAX_ADAPTER_WEIGHT:g}: its outputs would overflow to NaN"
        )
