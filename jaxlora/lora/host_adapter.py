"""One adapter in host memory, validated and ready to be written into a device slot.

Layout, per target module m (canonical order of `config.TARGET_MODULES`):

    weights[m] = (a, b)
      a: [num_layers, in_features, r_m]   float32, PEFT's lora_A.weight transposed
      b: [num_layers, r_m, out_features]  float32, PEFT's lora_B.weight transposed, times the PEFT scale

so that the adapter's term for layer l is `x @ a[l] @ b[l]`. `r_m` is the largest rank the module uses
in any layer; smaller ranks and layers the adapter does not transform are zero-padded, which adds
exact zeros. The scale (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA, after
`rank_pattern` / `alpha_pattern`) is already folded into `b`, so nothing downstream needs alpha.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so np.dtype("bfloat16") works)
import numpy as np

from jaxlora.config import TARGET_MODULES

Weights = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class HostAdapter:
    """A LoRA adapter on the host, scale folded in (see the module docstring for the layout).

    Attributes:
      name: the name requests use to pick the adapter.
      rank: the largest rank over all modules and layers (the bank's max_rank must be >= it).
      target_modules: modules with a LoRA term, in the canonical order of `TARGET_MODULES`.
      weights: module -> (a [L, in, r_m], b [L, r_m, out]), float32, read-only.
      source: where the adapter was loaded from (a folder path), for messages.
      base_model_name_or_path: what the adapter says it was trained on, if it says.
    """

    name: str
    rank: int
    target_modules: tuple[str, ...]
    weights: Weights
    source: str = ""
    base_model_name_or_path: str | None = None

    def __post_init__(self) -> None:
        if set(self.weights) != set(self.target_modules):
            raise ValueError(f"weights cover {sorted(self.weights)} but target_modules={list(self.target_modules)}")
        unknown = set(self.target_modules) - set(TARGET_MODULES)
        if unknown:
            raise ValueError(f"unknown target modules {sorted(unknown)}; known: {', '.join(TARGET_MODULES)}")
        ranks = {m: _check_pair(m, a, b) for m, (a, b) in self.weights.items()}
        if self.rank != max(ranks.values(), default=0):
            raise ValueError(f"rank={self.rank} but the largest module rank is {max(ranks.values(), default=0)}")
        for a, b in self.weights.values():
            a.setflags(write=False)
            b.setflags(write=False)
        object.__setattr__(self, "target_modules", tuple(m for m in TARGET_MODULES if m in self.target_modules))

    @property
    def num_layers(self) -> int:
        return next(iter(self.weights.values()))[0].shape[0] if self.weights else 0

    @property
    def nbytes(self) -> int:
        """Host bytes held by the weights (float32, at each module's own rank)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def module_rank(self, module: str) -> int:
        return self.weights[module][0].shape[-1]

    def padded(self, max_rank: int, dtype: np.dtype | str | type = np.float32) -> Weights:
        """Every module's (a [L, in, max_rank], b [L, max_rank, out]) in `dtype`, rank zero-padded.

        Raises:
          ValueError: if the adapter's rank exceeds max_rank.
        """
        if self.rank > max_rank:
            raise ValueError(f"adapter {self.name!r}: rank={self.rank} must be <= {max_rank=}")
        dtype = np.dtype(dtype)
        out: Weights = {}
        for m in self.target_modules:
            a, b = self.weights[m]
            num_layers, d_in, r = a.shape
            a_pad = np.zeros((num_layers, d_in, max_rank), dtype)
            b_pad = np.zeros((num_layers, max_rank, b.shape[-1]), dtype)
            a_pad[:, :, :r] = a
            b_pad[:, :r, :] = b
            out[m] = (a_pad, b_pad)
        return out


def _check_pair(module: str, a: np.ndarray, b: np.ndarray) -> int:
    """The rank of one module's (a, b) pair; ValueError if the two do not fit together."""
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"{module}: a {a.shape} and b {b.shape} are not [L, in, r] and [L, r, out]")
    if a.dtype != np.float32 or b.dtype != np.float32:
        raise ValueError(f"{module}: weights must be float32, got {a.dtype} and {b.dtype}")
    return a.shape[2]
