"""Transformer building blocks shared by `spmd.zoo.gpt` and `spmd.zoo.moe`.

Every weight is an `nnx.Param` created through `nnx.with_partitioning`, so it carries
logical axis names (read them with `nnx.get_partition_spec(nnx.state(model))`). The
blocks write their math as explicit `jnp.einsum`s rather than calling fused kernels: the
planner in `spmd` sees each contraction as one `dot_general` whose dims it can split.

Blocks take their sizes as arguments (not a whole config object) and a `Keys` only
to initialize; they never store it, so a model's state is Params (and, elsewhere,
BatchStats) and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Initializer = jax.nn.initializers.Initializer

# GPT-2 / Megatron initialization: N(0, 0.02) for every kernel and embedding.
INIT_STD = 0.02


class Keys:
    """Hands out PRNG keys fold_in(key(seed), 0), fold_in(key(seed), 1), ... .

    Used instead of `nnx.Rngs` to initialize the transformers: each `nnx.Rngs` draw writes
    a traced counter Variable, and under `nnx.eval_shape` every such write costs time
    linear in the program traced so far (jax looks up the tracer's origin), which made
    building gpt-13b abstractly take seconds. Never stored on a module.

    `seed` may also be a typed PRNG key: a stack of layers is built under `nnx.vmap`, one
    (traced) key per layer, since `nnx.split_rngs` only splits `nnx.Rngs`.
    """

    def __init__(self, seed: int | jax.Array):
        self._key = seed if isinstance(seed, jax.Array) else jax.random.key(seed)
        self._count = 0

    def __call__(self) -> jax.Array:
        self._count += 1
        return jax.random.fold_in(self._key, self._count - 1)


def named_param(
    rngs: Keys,
    init: Initializer,
    shape: Sequence[int],
    names: Sequence[str | None],
    dtype: jnp.dtype = jnp.float32,
) -> nnx.Param:
    """An `nnx.Param` of `shape` initialized by `init`, annotated with logical `names`.

    Going through `nnx.with_partitioning` (rather than a metadata keyword) keeps this
    independent of the metadata key, which flax renamed across 0.11-0.12.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    return nnx.Param(nnx.with_partitioning(init, tuple(names))(rngs(), tuple(shape), dtype))


def named_variable(cls: type[nnx.Variable], value: jax.Array, names: Sequence[str | None]):
    """`cls(value)` annotated with logical `names`, e.g. a BatchStat that flax created bare."""
    if len(names) != value.ndim:
        raise ValueError(f"logical names {tuple(names)} do not match shape {value.shape}")
    return cls(nnx.with_partitioning(lambda: value, tuple(names))())


def normal(std: float = INIT_STD) -> Initializer:
    """N(0, std) initializer."""
    return jax.nn.initializers.normal(stddev=std)


zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim (`embed`), statistics in fp32 whatever the compute dtype."""

    def __init__(self, dim: int, *, rngs: Keys, eps: float = 1e-5):
        self.eps = eps
        self.scale = named_param(rngs, ones, (dim,), ("embed",))
        self.bias = named_param(rngs, zeros, (dim,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # (..., embed)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...] + self.bias[...]
        return y.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with separate q/k/v projections.

    Projections keep heads as their own dim, (embed, heads, kv), so Megatron-style tensor
    parallelism is "split the `heads` axis" with no reshapes in the way.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        out_std: float,
        dtype: jnp.dtype,
        rngs: Keys,
    ):
        self.dtype = dtype
        self.head_dim = head_dim
        qkv_shape = (d_model, num_heads, head_dim)
        qkv_names = ("embed", "heads", "kv")
        self.wq = named_param(rngs, normal(), qkv_shape, qkv_names)
        self.wk = named_param(rngs, normal(), qkv_shape, qkv_names)
        self.wv = named_param(rngs, normal(), qkv_shape, qkv_names)
        self.bq = named_param(rngs, zeros, (num_heads, head_dim), ("heads", "kv"))
        self.bk = named_param(rngs, zeros, (num_heads, head_dim), ("heads", "kv"))
        self.bv = named_param(rngs, zeros, (num_heads, head_dim), ("heads", "kv"))
        self.wo = named_param(
            rngs, normal(out_std), (num_heads, head_dim, d_model), ("heads", "kv", "embed")
        )
        self.bo = named_param(rngs, zeros, (d_model,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        seq = x.shape[1]
        q = jnp.einsum("bse,ehk->bshk", x, self.wq[...].astype(dt)) + self.bq[...].astype(dt)
        k = jnp.einsum("bse,ehk->bshk", x, self.wk[...].astype(dt)) + self.bk[...].astype(dt)
        v = jnp.einsum("bse,ehk->bshk", x, self.wv[...].astype(dt)) + self.bv[...].astype(dt)
        # q, k, v: (batch, seq, heads, kv)
        scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(self.head_dim)  # (batch, heads, q, t)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))  # (q, t)
        scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)  # softmax in fp32 for stability
        out = jnp.einsum("bhqt,bthk->bqhk", probs, v)  # (batch, seq, heads, kv)
        y = jnp.einsum("bshk,hke->bse", out, self.wo[...].astype(dt))  # (batch, seq, embed)
        return y + self.bo[...].astype(dt)


class FeedForward(nnx.Module):
    """Two-layer GELU MLP, (embed, mlp) then (mlp, embed), with biases (GPT-2)."""

    def __init__(
        self, d_model: int, d_ff: int, *, out_std: float, dtype: jnp.dtype, rngs: Keys
    ):
        self.dtype = dtype
        self.wi = named_param(rngs, normal(), (d_model, d_ff), ("embed", "mlp"))
        self.bi = named_param(rngs, zeros, (d_ff,), ("mlp",))
        self.wo = named_param(rngs, normal(out_std), (d_ff, d_model), ("mlp", "embed"))
        self.bo = named_param(rngs, zeros, (d_model,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        h = jnp.einsum("bse,ef->bsf", x, self.wi[...].astype(dt)) + self.bi[...].astype(dt)
        h = jax.nn.gelu(h)  # (batch, seq, mlp)
        y = jnp.einsum("bsf,fe->bse", h, self.wo[...].astype(dt))  # (batch, seq, embed)
        return y + self.bo[...].astype(dt)


class Embeddings(nnx.Module):
    """Token table (vocab, embed) plus learned positions (pos, embed); the token table is
    reused, transposed, as the output projection (weight tying, GPT-2)."""

    def __init__(self, vocab_size: int, max_seq: int, d_model: int, *, dtype, rngs: Keys):
        self.dtype = dtype
        self.wte = named_param(rngs, normal(), (vocab_size, d_model), ("vocab", "embed"))
        self.wpe = named_param(rngs, normal(), (max_seq, d_model), ("pos", "embed"))

    def encode(self, tokens: jax.Array) -> jax.Array:
        seq = tokens.shape[1]
        x = jnp.take(self.wte[...], tokens, axis=0)  # (batch, seq, embed)
        x = x + self.wpe[...][:seq][None]  # positions 0..seq-1
        return x.astype(self.dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        logits = jnp.einsum("bse,ve->bsv", x, self.wte[...].astype(self.dtype))
        return logits.astype(jnp.float32)  # (batch, seq, vocab); the loss is taken in fp32


def lm_batch(vocab_size: int, seq_len: int, batch_size: int, seed: int) -> dict[str, jax.Array]:
    """Synthetic language-model batch: each row counts through the vocabulary with its own
    random start and stride, so the next token is predictable from context and a few
    training steps visibly lower the loss (pure noise would plateau at log(vocab)).

    Returns {"inputs": int32 (batch, seq), "targets": int32 (batch, seq)} with
    targets[:, t] == the token after inputs[:, t].
    """
    k_start, k_stride = jax.random.split(jax.random.key(seed))
    start = jax.random.randint(k_start, (batch_size, 1), 0, vocab_size)
    stride = jax.random.randint(k_stride, (batch_size, 1), 1, 8)
    t = jnp.arange(seq_len + 1)[None]  # (1, seq+1)
    tokens = ((start + stride * t) % vocab_size).astype(jnp.int32)  # (batch, seq+1)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in fp32; logits (batch, seq, vocab), targets (batch, seq)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.mean()


def canonical_dtype(dtype: object) -> str:
    """Name of a compute dtype ("float32", "bfloat16", ...): configs hold the name, not the
    type object, so they stay hashable, printable and settable from a command line."""
    try:
        return jnp.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"unknown dtype {dtype!r}: use e.g. 'float32' or 'bfloat16'") from e


def check_positive(config: object, *fields: str) -> None:
    """Raise ValueError naming the first of `fields` of `config` that is not a positive int."""
    for f in fields:
        v = getattr(config, f)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{type(config).__module__}.Config.{f} must be a positive int, got {v!r}")
