"""The optimizer and train step every model in the zoo shares.

The train step is a plain function of (model, optimizer, batch): not jitted, so `spmd`
can trace it once and wrap it in its own sharded `jax.jit`. Everything it changes (params,
optimizer state, BatchNorm statistics) it changes by NNX state mutation, which the
wrapper threads through as explicit inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from flax import nnx

LossFn = Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]

# AdamW defaults follow GPT-3 (Brown et al. 2020, Appendix B: beta2 0.95, weight decay
# 0.1), with the weight decay scaled down to 0.01 for the short runs the benchmarks do.
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
B1 = 0.9
B2 = 0.95


def make_optimizer(
    model: nnx.Module,
    *,
    learning_rate: float = LEARNING_RATE,
    weight_decay: float = WEIGHT_DECAY,
    b1: float = B1,
    b2: float = B2,
) -> nnx.Optimizer:
    """AdamW over the model's `nnx.Param`s.

    `wrt=nnx.Param` leaves BatchStats alone, and `nnx.Optimizer` copies each param's
    logical axis names onto its moment estimates, so the planner can shard optimizer state
    like the param it belongs to (ZeRO/FSDP).
    """
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def train_step(
    loss_fn: LossFn,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: dict[str, jax.Array],
) -> dict[str, jax.Array]:
    """One AdamW step on `loss_fn(model, batch)`; returns {"loss": the loss before the step}."""
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))
    loss, grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}
