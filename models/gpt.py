"""GPT: a decoder-only transformer (GPT-2 / GPT-3 architecture) in Flax NNX.

Pre-LayerNorm blocks, learned position embeddings, causal self-attention with separate
q/k/v projections shaped (embed, heads, kv), a GELU MLP, a final LayerNorm and output
logits tied to the token embedding. By default layers are unrolled in a Python loop so
each one is its own stretch of the traced program, which is what the planner's layer
clustering and pipeline stages cut along. With `Config.scan_layers` the blocks are one
stacked module (every param gains a leading dim named `layers`) run by `nnx.scan`, so
the traced program holds one layer's body whatever the depth. With `Config.remat` each
block runs under `jax.checkpoint` with that policy, as a user's own model would (spmd keeps
a step's checkpoints as they are written).

Batch: {"inputs": int32 (batch, seq), "targets": int32 (batch, seq)}; loss is the mean
next-token cross-entropy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from . import layers


#: ``Config.remat`` -> the jax.checkpoint policy around each block (None: no checkpoint); the
#: names are spmd's own remat policies (``spmd.memory.remat``)
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "recompute_all": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True)
class Config:
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 8
    head_dim: int = 8  # d_model // num_heads in every listed size, but its own field (the `kv` dim)
    d_ff: int = 256  # 4 * d_model in GPT-2/3
    vocab_size: int = 256  # 51200 for the real sizes: GPT-2's 50257 padded to a multiple of 1024 (Megatron)
    seq_len: int = 32  # tokens per example; also the number of learned positions
    dtype: str = "float32"  # compute dtype; params stay fp32 (mixed precision)
    scan_layers: bool = False  # stack the blocks along a `layers` dim and loop with nnx.scan
    # jax.checkpoint around each block, as a user writes it (spmd keeps it: a pin): "none",
    # "save_dots" (dots_with_no_batch_dims_saveable) or "recompute_all" (nothing_saveable)
    remat: str = "none"

    def __post_init__(self):
        layers.check_positive(
            self, "num_layers", "d_model", "num_heads", "head_dim", "d_ff", "vocab_size", "seq_len"
        )
        object.__setattr__(self, "dtype", layers.canonical_dtype(self.dtype))
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"spmd.zoo.gpt.Config.scan_layers must be a bool: {self.scan_layers!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"spmd.zoo.gpt.Config.remat must be one of {sorted(REMAT_POLICIES)}: "
                             f"{self.remat!r}")


def _size(num_layers: int, d_model: int, num_heads: int) -> Config:
    return Config(
        num_layers=num_layers,
        d_model=d_model,
        num_heads=num_heads,
        head_dim=d_model // num_heads,
        d_ff=4 * d_model,
        vocab_size=51200,
        seq_len=1024,
    )


# The GPT-3 family (Brown et al. 2020, Table 2.1) as benchmarked by Megatron-LM
# (Narayanan et al. 2021) and Alpa (Zheng et al. OSDI'22, Table 4): layers, d_model, heads.
SIZES: dict[str, Config] = {
    "tiny": Config(),
    # gpt-tiny's blocks stacked and scanned, four of them: a pipeline of 2 stages x 2
    # repeats (the SPMD runtime's circular schedule) splits the stack
    "tiny-scan": Config(num_layers=4, scan_layers=True),
    "125m": _size(12, 768, 12),
    "350m": _size(24, 1024, 16),
    "760m": _size(24, 1536, 16),
    "1.3b": _size(24, 2048, 32),
    "2.6b": _size(32, 2560, 32),
    "6.7b": _size(32, 4096, 32),
    "13b": _size(40, 5120, 40),
}

# Default global batch (sequences) per size: small enough to fit one 80 GB GPU's worth
# of activations per 8 devices without remat at seq 1024.
DEFAULT_BATCH_SIZES: dict[str, int] = {
    "tiny": 8,
    "tiny-scan": 8,
    "125m": 32,
    "350m": 32,
    "760m": 16,
    "1.3b": 16,
    "2.6b": 16,
    "6.7b": 8,
    "13b": 8,
}

UNIT = "tokens"

# Logical name of the stacked layer dim (scan_layers=True). The vmap that builds the stack
# and the scan that runs it both name it, so each layer's body sees its params' own names.
LAYERS = "layers"
_LAYERS_METADATA = {nnx.PARTITION_NAME: LAYERS}


class Block(nnx.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        d_ff: int,
        *,
        out_std: float,
        dtype: jnp.dtype,
        rngs: layers.Keys,
    ):
        self.ln1 = layers.LayerNorm(d_model, rngs=rngs)
        self.attn = layers.CausalSelfAttention(
            d_model, num_heads, head_dim, out_std=out_std, dtype=dtype, rngs=rngs
        )
        self.ln2 = layers.LayerNorm(d_model, rngs=rngs)
        self.mlp = layers.FeedForward(d_model, d_ff, out_std=out_std, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))  # (batch, seq, embed)
        return x + self.mlp(self.ln2(x))


def residual_std(num_layers: int) -> float:
    """GPT-2 (Radford et al. 2019, §2.3) scales the init of projections that write into the
    residual stream by 1/sqrt(N), N = 2 per layer, so the stream's variance does not grow
    with depth."""
    return layers.INIT_STD / math.sqrt(2 * num_layers)


class GPT(nnx.Module):
    def __init__(self, config: Config, *, rngs: layers.Keys):
        self.config = config
        dt = jnp.dtype(config.dtype)
        c = config
        self.embed = layers.Embeddings(c.vocab_size, c.seq_len, c.d_model, dtype=dt, rngs=rngs)
        out_std = residual_std(c.num_layers)

        def make_block(keys: layers.Keys) -> Block:
            return Block(
                c.d_model, c.num_heads, c.head_dim, c.d_ff, out_std=out_std, dtype=dt, rngs=keys
            )

        if c.scan_layers:
            self.blocks = _stacked(make_block, c.num_layers, rngs)
        else:
            self.blocks = nnx.List([make_block(rngs) for _ in range(c.num_layers)])
        self.ln_f = layers.LayerNorm(c.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int32 (batch, seq) -> logits fp32 (batch, seq, vocab)."""
        x = self.embed.encode(tokens)  # (batch, seq, embed)
        if self.config.scan_layers:
            x = _scanner(self.config.remat)(self.blocks, x)
        else:
            run = _block_runner(self.config.remat)
            for block in self.blocks:
                x = run(block, x)
        return self.embed.decode(self.ln_f(x))


def _stacked(
    make_block: Callable[[layers.Keys], Block], num_layers: int, rngs: layers.Keys
) -> Block:
    """`num_layers` blocks as one Block whose params have a leading `layers` dim.

    One key is drawn from `rngs` and split per layer; each layer initializes from its own
    `Keys` under `nnx.vmap` (`nnx.split_rngs` does not apply: `Keys` is not `nnx.Rngs`).
    """
    stack = nnx.vmap(lambda key: make_block(layers.Keys(key)), transform_metadata=_LAYERS_METADATA)
    return stack(jax.random.split(rngs(), num_layers))


def _run_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


@functools.cache
def _block_runner(remat: str) -> Callable[[Block, jax.Array], jax.Array]:
    """``block(x)``, under ``jax.checkpoint`` with ``remat``'s policy unless it is "none"."""
    policy = REMAT_POLICIES[remat]
    return _run_block if policy is None else nnx.remat(_run_block, policy=policy)


@functools.cache
def _scanner(remat: str) -> Callable[[Block, jax.Array], jax.Array]:
    """Apply a stacked Block layer by layer (the residual stream x is the carry), each
    layer under ``remat`` (``_block_runner``)."""
    run = _block_runner(remat)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata=_LAYERS_METADATA)
    def scan_blocks(block: Block, x: jax.Array) -> jax.Array:
        return run(block, x)

    return scan_blocks


def create(config: Config, seed: int = 0) -> GPT:
    """A GPT with fp32 params from `seed`; pure, so it can run under `nnx.eval_shape` or a
    `jax.jit` with out_shardings. Eager sharding is off: the logical names are metadata for
    the planner, not a request to place arrays on the current mesh."""
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=layers.Keys(seed))


def make_batch(config: Config, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    return layers.lm_batch(config.vocab_size, config.seq_len, batch_size, seed)


def loss(model: GPT, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (fp32)."""
    return layers.cross_entropy(model(batch["inputs"]), batch["targets"])


def items_per_batch(config: Config, batch_size: int) -> int:
    return batch_size * config.seq_len
