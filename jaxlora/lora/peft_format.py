"""Hugging Face PEFT LoRA folders (adapter_config.json + adapter_model.safetensors) <-> HostAdapter.

The config is honoured the way PEFT 0.21 (`peft/tuners/lora`, `peft/tuners/tuners_utils.py`) applies it
to a LlamaForCausalLM, whose modules are named `model.layers.{i}.self_attn.q_proj` and so on:

- `target_modules`: a list matches a module whose full name equals an entry or ends with `.entry`; a
  string is a regex that must match the full name (`re.fullmatch`); `"all-linear"` is every Linear
  except the output head. Missing (null) means PEFT's Llama default, q_proj and v_proj.
- `exclude_modules` (list or regex) removes modules, as in PEFT.
- `layers_to_transform` (int or list) and `layers_pattern` restrict list targets to those layers. As in
  PEFT, they do not apply to list entries that name a module in full, and are invalid with a regex.
- `rank_pattern` / `alpha_pattern`: the first key `k` (in file order) for which
  `re.match(rf"(.*\\.)?({k})$", full_name)` holds gives that module's r / lora_alpha.
- scale = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`; folded into B at load.
- `fan_in_fan_out` is accepted and ignored: PEFT resets it to False for torch Linear layers, which all
  Llama projections are, so the saved tensors are always [r, in] / [out, r].

Everything that changes the forward pass beyond `x @ A.T @ B.T * scale` on the seven projections is
rejected (see `_UNSUPPORTED`), as is anything pickled: only safetensors files are ever opened.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from jaxlora.config import TARGET_MODULES, ModelConfig
from jaxlora.errors import AdapterError, ModelLoadError
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.validate import RANK_HINT, check_adapter_name, check_weight_magnitude, weights_within_bound
from jaxlora.safetensors_map import CODES, UnsupportedDtypeError, map_file
from jaxlora.weights_file import save_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_KEY_PREFIX = "base_model.model."
# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"], used when target_modules is null.
_LLAMA_DEFAULT_TARGETS = ("q_proj", "v_proj")
_PARENT = {m: "self_attn" for m in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    m: "mlp" for m in ("gate_proj", "up_proj", "down_proj")
}
_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}

# Config keys whose non-default value changes what the adapter computes; none of them is served.
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (use_dora: true) is not supported",
    "lora_bias": "a bias on lora_B (lora_bias: true) is not supported",
    "modules_to_save": "fully trained extra modules (modules_to_save) are not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices) are not supported",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora: true) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported: it modifies the base weights",
}
# init_lora_weights values after which the adapter only works on base weights PEFT rewrote at init
# (unless saved with path_initial_model_for_weight_conversion, which resets the field to true).
_BASE_MODIFYING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


def module_key(layer: int, module: str) -> str:
    """The module's full name inside a LlamaForCausalLM, as PEFT matches it."""
    return f"model.layers.{layer}.{_PARENT[module]}.{module}"


def tensor_key(layer: int, module: str, which: str) -> str:
    """The name PEFT saves lora_A / lora_B under (which is "A" or "B")."""
    return f"{_KEY_PREFIX}{module_key(layer, module)}.lora_{which}.weight"


def llama_module_names(num_layers: int) -> list[str]:
    """Every module name `LlamaForCausalLM.named_modules()` yields (the root excluded), in order."""
    names = ["model", "model.embed_tokens", "model.layers"]
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn"]
        names += [module_key(i, m) for m in TARGET_MODULES[:4]]
        names += [f"{layer}.mlp"] + [module_key(i, m) for m in TARGET_MODULES[4:]]
        names += [f"{layer}.mlp.act_fn", f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    return names + ["model.norm", "model.rotary_emb", "lm_head"]


class _AllLinear:
    """Marker for target_modules: "all-linear"."""


ALL_LINEAR = _AllLinear()
Targets = frozenset[str] | re.Pattern[str] | _AllLinear


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """The parts of adapter_config.json that decide which modules get LoRA and with what scale."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: Targets
    exclude_modules: frozenset[str] | re.Pattern[str] | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def is_targeted(self, key: str) -> bool:
        """PEFT's check_target_module_exists for a module's full name `key`."""
        if self._is_excluded(key):
            return False
        if isinstance(self.target_modules, _AllLinear):
            return key.rsplit(".", 1)[-1] in TARGET_MODULES and key.startswith("model.layers.")
        if isinstance(self.target_modules, re.Pattern):
            return self.target_modules.fullmatch(key) is not None
        if key in self.target_modules:
            return True  # a full name: layers_to_transform does not apply (as in PEFT)
        if not any(key.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        layer = self._layer_index(key)
        return layer is not None and layer in self.layers_to_transform

    def rank_and_alpha(self, key: str) -> tuple[int, float]:
        """(r, lora_alpha) of the module named `key` after rank_pattern / alpha_pattern."""
        return (
            self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r),
            self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.lora_alpha),
        )

    def scale(self, key: str) -> float:
        r, alpha = self.rank_and_alpha(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def max_rank(self) -> int:
        """The largest rank any module may have (r, or a rank_pattern entry)."""
        return max([self.r, *self.rank_pattern.values()])

    def _is_excluded(self, key: str) -> bool:
        if self.exclude_modules is None:
            return False
        if isinstance(self.exclude_modules, re.Pattern):
            return self.exclude_modules.fullmatch(key) is not None
        return key in self.exclude_modules or any(key.endswith(f".{e}") for e in self.exclude_modules)

    def _layer_index(self, key: str) -> int | None:
        # The first numbered segment, as PEFT finds it (lazy match, so nested indices are not taken).
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            m = None
            for pattern in self.layers_pattern:
                m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if m:
                    break
        return int(m.group("idx")) if m else None


def _pattern_key(patterns: Mapping[str, Any], key: str) -> str:
    """PEFT's get_pattern_key: the first pattern matching a dotted suffix of `key`, else `key`."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


# ----------------------------------------------------------------------------------------------
# Loading


def load_peft_adapter(path: str | Path, *, name: str, model_config: ModelConfig, max_rank: int) -> HostAdapter:
    """Reads and validates a PEFT LoRA folder for the model described by `model_config`.

    Args:
      path: the folder holding adapter_config.json and adapter_model.safetensors.
      name: the adapter's name (1-128 of `A-Za-z0-9._-`).
      model_config: the base model; every tensor must fit its projection shapes and layer count.
      max_rank: the bank's rank limit R; any module rank above it is refused.

    Returns:
      A HostAdapter with float32 weights, scale folded into B.

    Raises:
      AdapterError: naming the adapter, the tensor (where one is at fault) and the reason.
    """
    name = check_adapter_name(name)
    if max_rank < 1:
        raise ValueError(f"{max_rank=} must be >= 1")
    folder = Path(path)
    where = f"adapter {name!r} ({folder})"
    if not folder.is_dir():
        raise AdapterError(f"{where}: not a directory")
    raw = _read_config(folder, where)
    spec = parse_lora_config(raw, where=where)
    tensors = _read_weights(folder, where)
    pairs = _collect_pairs(tensors, model_config, where)
    _check_coverage(pairs, spec, model_config, where)
    weights = {}
    for module in TARGET_MODULES:
        layers = {i: ab for (i, m), ab in pairs.items() if m == module}
        if layers:
            scales = {
                i: _check_pair(i, module, a, b, spec, model_config, max_rank, where) for i, (a, b) in layers.items()
            }
            weights[module] = _stack_folded(module, layers, scales, model_config, where)
    base = raw.get("base_model_name_or_path")
    return HostAdapter(
        name=name,
        rank=max(a.shape[-1] for a, _ in weights.values()),
        target_modules=tuple(weights),
        weights=weights,
        source=str(folder),
        base_model_name_or_path=base if isinstance(base, str) else None,
    )


def read_lora_spec(path: str | Path) -> LoraSpec:
    """The LoraSpec of a PEFT folder's adapter_config.json, without reading its weights (cheap: the
    command line sizes the bank from it before loading anything). Raises AdapterError."""
    folder = Path(path)
    where = f"adapter {folder}"
    return parse_lora_config(_read_config(folder, where), where=where)


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{where}: no {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
    return raw


def parse_lora_config(raw: Mapping[str, Any], *, where: str = "adapter") -> LoraSpec:
    """A LoraSpec from adapter_config.json contents; AdapterError for what jaxlora cannot serve.

    Keys this function does not mention (PEFT writes many) are ignored.
    """

    def fail(reason: str) -> AdapterError:
        return AdapterError(f"{where}: {CONFIG_FILE}: {reason}")

    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not supported (only LORA)")
    for key, reason in _UNSUPPORTED.items():
        if raw.get(key):
            raise fail(reason)
    if raw.get("bias", "none") not in ("none", None):
        raise fail(f"bias {raw['bias']!r} is not supported (only 'none')")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise fail(
            f"init_lora_weights {init!r} rewrites the base weights; save the adapter with PEFT's "
            "path_initial_model_for_weight_conversion to get a plain LoRA"
        )
    r = _rank(raw.get("r", 8), "r", fail)
    targets = _parse_targets(raw.get("target_modules"), fail)
    layers = raw.get("layers_to_transform")
    layers_pattern = raw.get("layers_pattern")
    if not isinstance(targets, frozenset) and (layers not in (None, []) or layers_pattern):
        raise fail("layers_to_transform / layers_pattern cannot be used with a string target_modules")
    if layers_pattern and layers in (None, []):
        raise fail("layers_pattern needs layers_to_transform")
    return LoraSpec(
        r=r,
        lora_alpha=_number(raw.get("lora_alpha", 8), "lora_alpha", fail),
        use_rslora=_bool(raw.get("use_rslora", False), "use_rslora", fail),
        target_modules=targets,
        exclude_modules=_parse_excludes(raw.get("exclude_modules"), fail),
        layers_to_transform=_parse_layers(layers, fail),
        layers_pattern=_str_list(layers_pattern, "layers_pattern", fail) if layers_pattern else None,
        rank_pattern=_parse_pattern(raw.get("rank_pattern"), "rank_pattern", fail, integer=True),
        alpha_pattern=_parse_pattern(raw.get("alpha_pattern"), "alpha_pattern", fail, integer=False),
    )


def _rank(value: Any, field: str, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(f"{field}={value!r} must be a positive integer")
    return value


def _number(value: Any, field: str, fail) -> float:
    # PEFT puts no sign on lora_alpha; a finite number is all the math needs.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(f"{field}={value!r} must be a finite number")
    return value


def _bool(value: Any, field: str, fail) -> bool:
    if not isinstance(value, bool):
        raise fail(f"{field}={value!r} must be true or false")
    return value


def _regex(pattern: str, field: str, fail) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise fail(f"{field} {pattern!r} is not a valid regex ({e})") from None


def _str_list(value: Any, field: str, fail) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise fail(f"{field} must be a string or a list of strings, got {value!r}")
    return tuple(value)


def _parse_targets(value: Any, fail) -> Targets:
    if value is None:
        return frozenset(_LLAMA_DEFAULT_TARGETS)
    if isinstance(value, str):
        return ALL_LINEAR if value.lower() == "all-linear" else _regex(value, "target_modules", fail)
    return frozenset(_str_list(value, "target_modules", fail))


def _parse_excludes(value: Any, fail) -> frozenset[str] | re.Pattern[str] | None:
    if not value:
        return None
    if isinstance(value, str):
        return _regex(value, "exclude_modules", fail)
    return frozenset(_str_list(value, "exclude_modules", fail))


def _parse_layers(value: Any, fail) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise fail(f"layers_to_transform must be an integer or a list of integers, got {value!r}")
    return tuple(values)


def _parse_pattern(value: Any, field: str, fail, *, integer: bool) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{field} must be an object mapping module patterns to values, got {value!r}")
    for key, v in value.items():
        _regex(key, f"{field} key", fail)
        (_rank if integer else _number)(v, f"{field}[{key!r}]", fail)
    return dict(value)


def _read_weights(folder: Path, where: str) -> dict[str, np.ndarray]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(
                f"{where}: only pickle weights ({', '.join(pickles)}); jaxlora never unpickles, "
                f"convert to {WEIGHTS_FILE}"
            )
        raise AdapterError(f"{where}: no {WEIGHTS_FILE}")
    # Read-only views of the mapped file: each weight is read once, by the copy that transposes,
    # widens and stacks it (`_stack_folded`), not first into an array of its own.
    try:
        mapped = map_file(path)
    except UnsupportedDtypeError as e:
        raise AdapterError(f"{where}: tensor {e.name}: dtype {e.code} is not a float type (F32/F16/BF16)") from None
    except ModelLoadError as e:
        raise AdapterError(f"{where}: cannot read {WEIGHTS_FILE} ({e})") from None
    tensors: dict[str, np.ndarray] = {}
    for key, tensor in mapped.items():
        if tensor.dtype.name not in _FLOAT_DTYPES:
            raise AdapterError(f"{where}: tensor {key}: dtype {CODES[tensor.dtype]} is not a float type (F32/F16/BF16)")
        tensors[key] = tensor.array()
    if not tensors:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no tensors (empty adapter)")
    return tensors


_LORA_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
_LAYER_KEY_RE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<proj>\w+)$")


def _collect_pairs(
    tensors: Mapping[str, np.ndarray], config: ModelConfig, where: str
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) -> (lora_A [r, in], lora_B [out, r]) as stored; unknown tensors are refused."""
    found: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        layer, module, which = _parse_key(key, config, where)
        slot = found.setdefault((layer, module), {})
        if which in slot:
            raise AdapterError(f"{where}: tensor {key}: duplicates {slot[which][0]}")
        slot[which] = (key, value)
    pairs = {}
    for (layer, module), slot in sorted(found.items()):
        for which in ("A", "B"):
            if which not in slot:
                present = next(iter(slot.values()))[0]
                raise AdapterError(
                    f"{where}: tensor {tensor_key(layer, module, which)}: missing "
                    f"(lora_{which} is needed alongside {present})"
                )
        pairs[(layer, module)] = (slot["A"][1], slot["B"][1])
    return pairs


def _parse_key(key: str, config: ModelConfig, where: str) -> tuple[int, str, str]:
    def fail(reason: str) -> AdapterError:
        return AdapterError(f"{where}: tensor {key}: {reason}")

    m = _LORA_KEY_RE.match(key)
    if m is None:
        if "lora_magnitude_vector" in key:
            raise fail("DoRA magnitude vector: DoRA is not supported")
        if re.search(r"\.lora_B(\.default)?\.bias$", key):
            raise fail("bias on lora_B (lora_bias) is not supported")
        if "lora_embedding_" in key:
            raise fail(
                f"LoRA on an embedding is not supported (jaxlora serves LoRA on {', '.join(TARGET_MODULES)} only)"
            )
        raise fail(
            "not a LoRA weight jaxlora can serve (expected ...lora_A.weight / ...lora_B.weight; "
            "modules_to_save and other extra tensors are not supported)"
        )
    module_name = m.group("module")
    lm = _LAYER_KEY_RE.match(module_name)
    if lm is None or _PARENT.get(lm.group("proj")) != lm.group("parent"):
        raise fail(
            f"the model has no LoRA-capable module {module_name!r} (jaxlora serves LoRA on "
            f"model.layers.N.{{self_attn,mlp}}.{{{','.join(TARGET_MODULES)}}} only)"
        )
    layer = int(lm.group("layer"))
    if layer >= config.num_layers:
        raise fail(f"layer index {layer} is out of range: the model has {config.num_layers} layers")
    return layer, lm.group("proj"), m.group("which")


def _check_coverage(pairs: Mapping[tuple[int, str], Any], spec: LoraSpec, config: ModelConfig, where: str) -> None:
    """The modules the config targets must be exactly the modules the file holds, all of them servable."""
    targeted = [k for k in llama_module_names(config.num_layers) if spec.is_targeted(k)]
    if not targeted:
        raise AdapterError(f"{where}: {CONFIG_FILE}: target_modules matches no module of the model (empty adapter)")
    servable = {module_key(i, m) for i in range(config.num_layers) for m in TARGET_MODULES}
    for key in targeted:
        if key not in servable:
            raise AdapterError(
                f"{where}: {CONFIG_FILE}: target_modules selects {key!r}, which is not a "
                f"LoRA target jaxlora serves (only {', '.join(TARGET_MODULES)})"
            )
    expected = {(int(k.split(".")[2]), k.rsplit(".", 1)[-1]) for k in targeted}
    for layer, module in sorted(set(pairs) - expected):
        raise AdapterError(
            f"{where}: tensor {tensor_key(layer, module, 'A')}: {module_key(layer, module)} is "
            f"not targeted by {CONFIG_FILE} (target_modules / layers_to_transform / exclude_modules)"
        )
    for layer, module in sorted(expected - set(pairs)):
        raise AdapterError(
            f"{where}: tensor {tensor_key(layer, module, 'A')}: missing ({CONFIG_FILE} targets "
            f"{module_key(layer, module)} but {WEIGHTS_FILE} has no lora_A/lora_B for it)"
        )


def _check_pair(
    layer: int,
    module: str,
    a: np.ndarray,
    b: np.ndarray,
    spec: LoraSpec,
    config: ModelConfig,
    max_rank: int,
    where: str,
) -> float:
    """Checks one module's PEFT pair (A [r, in], B [out, r]) against the model and the config;
    returns the scale folded into its B."""
    key = module_key(layer, module)
    r, _ = spec.rank_and_alpha(key)
    d_in, d_out = config.module_shape(module)
    a_key, b_key = tensor_key(layer, module, "A"), tensor_key(layer, module, "B")
    if a.ndim != 2 or a.shape[1] != d_in:
        raise AdapterError(
            f"{where}: tensor {a_key}: shape {list(a.shape)} does not fit the model (expected [r, {d_in}] for {module})"
        )
    if b.ndim != 2 or b.shape[0] != d_out:
        raise AdapterError(
            f"{where}: tensor {b_key}: shape {list(b.shape)} does not fit the model "
            f"(expected [{d_out}, r] for {module})"
        )
    if a.shape[0] != b.shape[1]:
        raise AdapterError(f"{where}: tensor {b_key}: rank {b.shape[1]} does not match lora_A's rank {a.shape[0]}")
    if a.shape[0] > max_rank:
        raise AdapterError(f"{where}: tensor {a_key}: rank {a.shape[0]} exceeds max_rank={max_rank} ({RANK_HINT})")
    if a.shape[0] != r:
        raise AdapterError(
            f"{where}: tensor {a_key}: rank {a.shape[0]} but {CONFIG_FILE} gives r={r} "
            "for this module (r / rank_pattern)"
        )
    return spec.scale(key)


def _stack_folded(
    module: str,
    layers: Mapping[int, tuple[np.ndarray, np.ndarray]],
    scales: Mapping[int, float],
    config: ModelConfig,
    where: str,
) -> tuple[np.ndarray, np.ndarray]:
    """One module's checked pairs {layer: (A [r_l, in], B [out, r_l])} -> (a [L, in, r], b [L, r, out])
    in float32, B times its layer's scale, r the largest r_l, layers and ranks missing zero.

    Each weight is copied once, transposed and widened on the way; the bound check then reads the
    stacked arrays once (it names the offending tensor only when one fails)."""
    d_in, d_out = config.module_shape(module)
    rank = max(a.shape[0] for a, _ in layers.values())
    a_all = np.zeros((config.num_layers, d_in, rank), np.float32)
    b_all = np.zeros((config.num_layers, rank, d_out), np.float32)
    for layer, (a, b) in layers.items():
        r = a.shape[0]
        a_all[layer, :, :r] = a.T
        b_layer = b_all[layer, :r]
        b_layer[...] = b.T
        if scales[layer] != 1.0:
            b_layer *= np.float32(scales[layer])
    if not (weights_within_bound(a_all) and weights_within_bound(b_all)):
        for layer in sorted(layers):
            for which, x in (("A", a_all[layer]), ("B", b_all[layer])):
                check_weight_magnitude(f"{where}: tensor {tensor_key(layer, module, which)}", x)
        raise AdapterError(f"{where}: {module}: a weight is NaN, Inf or above the bound")  # unreachable
    return a_all, b_all


# ----------------------------------------------------------------------------------------------
# Saving


def save_peft_adapter(
    path: str | Path,
    *,
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
    rank: int,
    alpha: float,
    target_modules: Iterable[str] | None = None,
    base_model_name_or_path: str = "",
    use_rslora: bool = False,
    dtype: str = "float32",
) -> Path:
    """Writes a standard PEFT LoRA folder that `PeftModel.from_pretrained` loads as is.

    Args:
      path: the folder to write (created if missing; existing adapter files are overwritten).
      weights: module -> (A [L, in, r_m], B [L, r_m, out]), UNSCALED (PEFT applies alpha / r itself).
        A module whose r_m differs from `rank` gets a rank_pattern entry.
      rank: the config's r.
      alpha: the config's lora_alpha.
      target_modules: the modules written; defaults to the keys of `weights`. Must equal them.
      base_model_name_or_path: recorded in the config (PEFT loads the base from it if asked).
      use_rslora: scale alpha / sqrt(r) instead of alpha / r.
      dtype: "float32", "float16" or "bfloat16" for the saved tensors.

    Returns:
      The folder.
    """
    named = set(weights if target_modules is None else target_modules)
    if named != set(weights) or not named <= set(TARGET_MODULES) or not named:
        raise ValueError(
            f"target_modules={sorted(named)} must equal the modules in weights "
            f"({sorted(weights)}), at least one, all from {', '.join(TARGET_MODULES)}"
        )
    modules = [m for m in TARGET_MODULES if m in named]
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"{dtype=} must be float32, float16 or bfloat16")
    tensors: dict[str, np.ndarray] = {}
    rank_pattern: dict[str, int] = {}
    for m in modules:
        a, b = weights[m]
        if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            raise ValueError(f"{m}: A {a.shape} and B {b.shape} must be [L, in, r] and [L, r, out]")
        if a.shape[2] != rank:
            rank_pattern[m] = int(a.shape[2])
        for layer in range(a.shape[0]):
            tensors[tensor_key(layer, m, "A")] = np.ascontiguousarray(a[layer].T).astype(dtype)
            tensors[tensor_key(layer, m, "B")] = np.ascontiguousarray(b[layer].T).astype(dtype)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(rank),
        "lora_alpha": alpha,
        "use_rslora": bool(use_rslora),
        "target_modules": modules,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "init_lora_weights": True,
        "use_dora": False,
        "inference_mode": True,
    }
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder
