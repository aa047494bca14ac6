"""`jaxlora train`: LoRA fine-tuning with optax, saved as a PEFT folder (see jaxlora.train)."""

from jaxlora.train.cli import add_train_args as add_args
from jaxlora.train.cli import run_train as run

__all__ = ["add_args", "run"]
