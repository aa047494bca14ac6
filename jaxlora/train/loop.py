"""The training loop: batches in, AdamW steps, a progress bar, held-out loss, resumable checkpoints.

The training state (LoRA weights, optimizer state, step) is checkpointed with orbax next to a JSON
record of the run's settings; `resume=True` continues from the latest checkpoint and refuses one
written with other settings. Batches are a pure function of (seed, step) (see `data.train_batch`),
so a resumed run sees exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jaxlora.kernels import StepKernels
from jaxlora.model.params import LoadedModel
from jaxlora.train.data import Batch, Example, eval_batches, train_batch
from jaxlora.train.lora_params import AdapterSpec, LoraParams, init_lora_params
from jaxlora.train.step import OptimizerConfig, eval_step, train_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides a run's result (recorded with each checkpoint).

    Attributes:
      spec: the adapter's rank, alpha and target modules.
      optim: AdamW and learning-rate schedule settings (num_steps is the run's length).
      batch_size: conversations per step.
      max_len: longest training sequence in tokens; longer conversations are truncated.
      seed: initialises A and orders the batches.
      eval_every: held-out loss every this many steps (and at the end); 0 only at the end.
      checkpoint_every: save the training state every this many steps (and at the end); 0 never.
    """

    spec: AdapterSpec
    optim: OptimizerConfig
    batch_size: int = 8
    max_len: int = 512
    seed: int = 0
    eval_every: int = 50
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_len < 2:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1 and max_len={self.max_len} >= 2")
        if self.eval_every < 0 or self.checkpoint_every < 0:
            raise ValueError("eval_every and checkpoint_every must be >= 0")

    def record(self) -> dict[str, Any]:
        """The settings a resumed run must share (JSON-able)."""
        out = dataclasses.asdict(self)
        out.pop("eval_every")
        out.pop("checkpoint_every")
        return json_safe(out)


@dataclasses.dataclass
class TrainResult:
    """params: the trained LoRA weights (unscaled); history: one dict per logged event."""

    params: LoraParams
    history: list[dict[str, float]]
    seconds: float
    start_step: int

    def last(self, key: str) -> float | None:
        values = [h[key] for h in self.history if key in h]
        return values[-1] if values else None

    def final_train_loss(self) -> float:
        """The training loss's moving average at the end (`moving_average`: what the progress bar
        shows; one step's loss is noisy)."""
        return moving_average([h["loss"] for h in self.history if "loss" in h])


LOSS_DECAY = 0.9  # the moving average's weight on the past: about the last 10 steps


def moving_average(losses: Sequence[float]) -> float:
    """The exponential moving average of `losses` (decay LOSS_DECAY), NaN for none."""
    average = math.nan
    for i, loss in enumerate(losses):
        average = loss if i == 0 else LOSS_DECAY * average + (1 - LOSS_DECAY) * loss
    return average


# Steps timed for the estimate: the first compiles, the next ones run as the rest will.
_TIMED_AFTER, _TIMED_STEPS = 1, 2


def _estimate(seconds: float, num_steps: int, left: int) -> str:
    per_step = seconds / _TIMED_STEPS
    return f"about {per_step:.2f} s per step: {left * per_step / 60:.1f} min for the {left} steps left of {num_steps}"


def train(
    model: LoadedModel,
    train_examples: Sequence[Example],
    eval_examples: Sequence[Example],
    config: TrainConfig,
    *,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    kernels: StepKernels = StepKernels(),
    description: str = "train",
    on_estimate: Callable[[str], None] | None = None,
) -> TrainResult:
    """Trains a LoRA adapter on `model` (whose params stay frozen) and returns its weights.
    `on_estimate` gets one line estimating the time left, once the first steps have run."""
    if not train_examples:
        raise ValueError("no training examples")
    statics = {"graphdef": model.graphdef, "spec": config.spec, "kernels": kernels}
    params = init_lora_params(jax.random.key(config.seed), model.config, config.spec)
    opt_state = config.optim.build().init(params)
    manager = _manager(checkpoint_dir, config) if checkpoint_dir is not None else None
    start, history = 0, []
    if manager is not None and resume and manager.latest_step() is not None:
        start, params, opt_state, history = _restore(manager, config, params, opt_state)
    schedule = config.optim.schedule()
    num_steps = config.optim.num_steps
    t0 = time.perf_counter()
    bar = tqdm(
        range(start, num_steps),
        desc=description,
        disable=not progress,
        initial=start,
        total=num_steps,
        dynamic_ncols=True,
    )
    smoothed = None
    timed_from = None
    for step in bar:
        if step == start + _TIMED_AFTER:
            timed_from = time.perf_counter()
        if on_estimate is not None and timed_from is not None and step == start + _TIMED_AFTER + _TIMED_STEPS:
            on_estimate(_estimate(time.perf_counter() - timed_from, num_steps, num_steps - step))
        batch = train_batch(
            train_examples, step, batch_size=config.batch_size, seed=config.seed, max_len=config.max_len
        )
        params, opt_state, metrics = train_step(
            params, opt_state, model.params, _device(batch), optim=config.optim, **statics
        )
        loss = float(metrics["loss"])
        smoothed = loss if smoothed is None else LOSS_DECAY * smoothed + (1 - LOSS_DECAY) * loss
        record = {"step": step + 1, "loss": loss, "grad_norm": float(metrics["grad_norm"]), "lr": float(schedule(step))}
        done = step + 1
        if eval_examples and (done == num_steps or (config.eval_every and done % config.eval_every == 0)):
            record["eval_loss"] = evaluate(model, params, eval_examples, config, kernels=kernels)
        history.append(record)
        bar.set_postfix(_postfix(smoothed, record, history), refresh=False)
        if manager is not None and (
            done == num_steps or (config.checkpoint_every and done % config.checkpoint_every == 0)
        ):
            _save(manager, done, params, opt_state, config, history)
    bar.close()
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    return TrainResult(params=params, history=history, seconds=time.perf_counter() - t0, start_step=start)


def evaluate(
    model: LoadedModel,
    params: LoraParams,
    examples: Sequence[Example],
    config: TrainConfig,
    *,
    kernels: StepKernels = StepKernels(),
) -> float:
    """Mean cross-entropy per response token over `examples`."""
    total, count = 0.0, 0.0
    for batch in eval_batches(examples, batch_size=config.batch_size, max_len=config.max_len):
        s, n = eval_step(
            params, model.params, _device(batch), graphdef=model.graphdef, spec=config.spec, kernels=kernels
        )
        total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)


def _device(batch: Batch) -> dict[str, jax.Array]:
    return {
        "tokens": jnp.asarray(batch.tokens),
        "targets": jnp.asarray(batch.targets),
        "weights": jnp.asarray(batch.weights),
    }


def _postfix(smoothed: float, record: dict, history: list[dict]) -> dict[str, str]:
    out = {"loss": f"{smoothed:.3f}", "lr": f"{record['lr']:.1e}"}
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    if evals:
        out["eval"] = f"{evals[-1]:.3f}"
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints: orbax, state + a JSON record of the settings and the history so far.


def _manager(directory: str | Path, config: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("state", "meta"))


def _save(
    manager: ocp.CheckpointManager, step: int, params, opt_state, config: TrainConfig, history: list[dict]
) -> None:
    meta = {"step": step, "config": config.record(), "history": history}
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt": opt_state}), meta=ocp.args.JsonSave(meta)
        ),
    )


def _restore(manager: ocp.CheckpointManager, config: TrainConfig, params, opt_state):
    step = manager.latest_step()
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta["config"] != config.record():
        changed = sorted(k for k in config.record() if meta["config"].get(k) != config.record()[k])
        raise ValueError(
            f"cannot resume from {manager.directory} (step {step}): it was written with other "
            f"settings ({', '.join(changed)} differ)"
        )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt_state})
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    return step, state["params"], state["opt"], list(meta["history"])


def json_safe(value: Any) -> Any:
    """Tuples -> lists, recursively, so a record compares equal to its JSON round trip."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
