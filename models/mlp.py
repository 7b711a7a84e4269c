"""A deep MLP in Flax NNX: the smallest model on which every sharding pattern shows up.

Dense layers alternate (embed -> mlp) and (mlp -> embed), ReLU between them, biases on
all. Alternating the logical names is what makes Megatron's pairing visible: split `mlp`
and the first layer needs no communication, the second ends with one all-reduce.

Batch: {"x": fp32 (batch, d_model), "y": fp32 (batch, d_model)}, y a fixed random
two-layer teacher of x; loss is the mean squared error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from . import layers


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 64
    d_hidden: int = 256
    num_layers: int = 4  # Dense layers, not pairs; even, so the output is d_model wide
    dtype: str = "float32"

    def __post_init__(self):
        layers.check_positive(self, "d_model", "d_hidden", "num_layers")
        if self.num_layers % 2:
            raise ValueError(f"mlp.Config.num_layers must be even, got {self.num_layers}")
        object.__setattr__(self, "dtype", layers.canonical_dtype(self.dtype))


SIZES: dict[str, Config] = {
    "tiny": Config(),
    "small": Config(d_model=512, d_hidden=2048, num_layers=4),
}
DEFAULT_BATCH_SIZES: dict[str, int] = {"tiny": 16, "small": 256}
UNIT = "samples"


def _dense(d_in: int, d_out: int, names: tuple[str, str], dtype, rngs: nnx.Rngs) -> nnx.Linear:
    init = jax.nn.initializers.lecun_normal()
    return nnx.Linear(
        d_in,
        d_out,
        kernel_init=nnx.with_partitioning(init, names),
        bias_init=nnx.with_partitioning(layers.zeros, (names[1],)),
        dtype=dtype,
        rngs=rngs,
    )


class MLP(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        dt = jnp.dtype(c.dtype)
        self.layers = nnx.List(
            [
                _dense(c.d_model, c.d_hidden, ("embed", "mlp"), dt, rngs)
                if i % 2 == 0
                else _dense(c.d_hidden, c.d_model, ("mlp", "embed"), dt, rngs)
                for i in range(c.num_layers)
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (batch, embed) -> (batch, embed)."""
        x = x.astype(jnp.dtype(self.config.dtype))
        for i, layer in enumerate(self.layers):
            x = layer(x)  # (batch, mlp) after even layers, (batch, embed) after odd
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


def create(config: Config, seed: int = 0) -> MLP:
    """An MLP with fp32 params from `seed` (pure; eager sharding off)."""
    with nnx.use_eager_sharding(False):
        return MLP(config, rngs=nnx.Rngs(params=seed))


def make_batch(config: Config, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """x ~ N(0, 1); y = tanh(x @ A) @ B / sqrt(d) with A, B fixed by `seed`, so the target
    is a smooth function the MLP can fit and the loss visibly drops."""
    k_x, k_a, k_b = jax.random.split(jax.random.key(seed), 3)
    d = config.d_model
    x = jax.random.normal(k_x, (batch_size, d), jnp.float32)  # (batch, embed)
    a = jax.random.normal(k_a, (d, d), jnp.float32) / jnp.sqrt(d)
    b = jax.random.normal(k_b, (d, d), jnp.float32)
    y = jnp.tanh(x @ a) @ b / jnp.sqrt(d)  # (batch, embed)
    return {"x": x, "y": y}


def loss(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error (fp32)."""
    pred = model(batch["x"]).astype(jnp.float32)
    return jnp.mean(jnp.square(pred - batch["y"]))


def items_per_batch(config: Config, batch_size: int) -> int:
    return batch_size
