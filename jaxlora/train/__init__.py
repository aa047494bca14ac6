"""LoRA training with optax: data, trainable weights, the jitted step, the loop, PEFT export."""
