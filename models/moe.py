"""A GShard-style mixture-of-experts transformer in Flax NNX.

GPT-like (see `spmd.zoo.gpt`), but every other block's FFN is a mixture of experts, as in
GShard (Lepikhin et al. 2020, §2.2 and Algorithm 1): a router picks each token's top-2
experts, tokens are packed into per-expert buffers of fixed capacity (overflow is dropped
and rides the residual connection), experts run as one einsum over an explicit `expert`
dim, and outputs are scattered back weighted by the normalized gates.

Dispatch and combine are dense einsums over one-hot (group, seq, expert, capacity)
tensors rather than gathers: with the `expert` dim split across devices, XLA turns the
dispatch einsum into the all-to-all of expert parallelism, which is exactly what the
planner should see and price. A group is one sequence (one batch row), so groups split
with the batch and capacity does not depend on the batch size.

Routing is deterministic (no GShard random second-expert dropping, no noise), so a
single-device and a sharded run compute the same thing.

Batch: {"inputs": int32 (batch, seq), "targets": int32 (batch, seq)}; loss is the mean
next-token cross-entropy plus `aux_loss_coef` times the mean load-balancing loss of the
MoE layers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from . import gpt, layers


@dataclasses.dataclass(frozen=True)
class Config:
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 8
    head_dim: int = 8
    d_ff: int = 128  # hidden size of the dense FFNs and of each expert
    num_experts: int = 8
    capacity_factor: float = 2.0  # GShard's training value; 2 top-2 slots per token on average
    aux_loss_coef: float = 0.01  # GShard / Switch weight of the load-balancing loss
    moe_every: int = 2  # blocks i with i % moe_every == moe_every - 1 are MoE (GShard: every other)
    vocab_size: int = 256
    seq_len: int = 32
    dtype: str = "float32"

    def __post_init__(self):
        layers.check_positive(
            self,
            "num_layers", "d_model", "num_heads", "head_dim", "d_ff",
            "num_experts", "moe_every", "vocab_size", "seq_len",
        )  # fmt: skip
        if self.num_experts < 2:
            raise ValueError("moe.Config.num_experts must be >= 2 for top-2 routing")
        if not self.capacity_factor > 0:
            raise ValueError(f"moe.Config.capacity_factor must be > 0, got {self.capacity_factor}")
        object.__setattr__(self, "dtype", layers.canonical_dtype(self.dtype))

    @property
    def capacity(self) -> int:
        """Slots per expert per group: ceil(cf * tokens_per_group * 2 / experts) (GShard)."""
        return expert_capacity(self.seq_len, self.num_experts, self.capacity_factor)


SIZES: dict[str, Config] = {
    "tiny": Config(),
    "small": Config(
        num_layers=4, d_model=256, num_heads=8, head_dim=32, d_ff=1024, vocab_size=1024, seq_len=64
    ),
}
DEFAULT_BATCH_SIZES: dict[str, int] = {"tiny": 8, "small": 32}
UNIT = "tokens"


def expert_capacity(tokens_per_group: int, num_experts: int, capacity_factor: float) -> int:
    """Per-expert buffer size for top-2 routing of `tokens_per_group` tokens."""
    return max(1, math.ceil(capacity_factor * tokens_per_group * 2 / num_experts))


def top2_gating(
    logits: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating (Lepikhin et al. 2020, Algorithm 1, without random dropping).

    Args:
      logits: router logits, (group, seq, expert).
      capacity: slots per expert per group.

    Returns:
      dispatch: (group, seq, expert, capacity) 0/1 in fp32; at most one 1 per (group, expert,
        slot) and at most two per token.
      combine: (group, seq, expert, capacity) fp32 gate weights at the dispatched slots; a
        token's weights sum to 1 when both its experts had room, less when one dropped it.
      aux_loss: scalar load-balancing loss, E * sum_e(fraction routed to e * mean gate of e),
        which is 1 for perfectly balanced routing.
    """
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # (g, s, e)

    mask1 = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts)  # (g, s, e) first choice
    gate1 = (probs * mask1).sum(-1)  # (g, s)
    mask2 = jax.nn.one_hot(jnp.argmax(probs * (1 - mask1), -1), num_experts)  # second choice
    gate2 = (probs * mask2).sum(-1)  # (g, s)

    # Load balancing on the first choice (GShard eq. 4; the E^2 scaling as in mesh-tensorflow).
    density = mask1.mean(1)  # (g, e) fraction of tokens whose first choice is e
    density_proxy = probs.mean(1)  # (g, e) differentiable stand-in for it
    aux_loss = (density * density_proxy).mean() * num_experts**2

    # Normalize the two gates before dropping, so a dropped choice lowers the token's total.
    denom = gate1 + gate2 + 1e-9
    gate1, gate2 = gate1 / denom, gate2 / denom

    # Slot of each token in its expert's buffer: first choices fill buffers in sequence
    # order, then second choices take what is left.
    pos1 = jnp.cumsum(mask1, axis=1) - 1  # (g, s, e)
    mask1 = mask1 * (pos1 < capacity)
    pos2 = jnp.cumsum(mask2, axis=1) - 1 + mask1.sum(1, keepdims=True)  # after the kept firsts
    mask2 = mask2 * (pos2 < capacity)

    def scatter(mask: jax.Array, pos: jax.Array) -> jax.Array:
        slot = (pos * mask).sum(-1).astype(jnp.int32)  # (g, s)
        return mask[..., None] * jax.nn.one_hot(slot, capacity)[:, :, None, :]  # (g, s, e, c)

    d1, d2 = scatter(mask1, pos1), scatter(mask2, pos2)
    dispatch = d1 + d2  # (g, s, e, c); the two choices are different experts, so no overlap
    combine = gate1[..., None, None] * d1 + gate2[..., None, None] * d2
    return dispatch, combine, aux_loss


class MoEFeedForward(nnx.Module):
    """Top-2 routed experts; each expert is a GELU MLP (embed -> mlp -> embed), no biases."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        capacity: int,
        *,
        out_std: float,
        dtype: jnp.dtype,
        rngs: layers.Keys,
    ):
        self.dtype = dtype
        self.capacity = capacity
        n = num_experts
        self.router = layers.named_param(rngs, layers.normal(), (d_model, n), ("embed", "expert"))
        self.wi = layers.named_param(
            rngs, layers.normal(), (n, d_model, d_ff), ("expert", "embed", "mlp")
        )
        self.wo = layers.named_param(
            rngs, layers.normal(out_std), (n, d_ff, d_model), ("expert", "mlp", "embed")
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x (group, seq, embed) -> (y of the same shape, aux load-balancing loss)."""
        dt = self.dtype
        # Einsum letters: g group, s seq, m embed, e expert, c capacity, f mlp.
        logits = jnp.einsum("gsm,me->gse", x.astype(jnp.float32), self.router[...])
        dispatch, combine, aux = top2_gating(logits, self.capacity)  # (g, s, e, c) each
        xe = jnp.einsum("gsec,gsm->egcm", dispatch.astype(dt), x)  # (expert, group, cap, embed)
        h = jax.nn.gelu(jnp.einsum("egcm,emf->egcf", xe, self.wi[...].astype(dt)))  # (e, g, c, mlp)
        ye = jnp.einsum("egcf,efm->egcm", h, self.wo[...].astype(dt))  # (expert, group, cap, embed)
        y = jnp.einsum("gsec,egcm->gsm", combine.astype(dt), ye)  # (group, seq, embed)
        return y, aux


class MoEBlock(nnx.Module):
    """Pre-LN block whose FFN is `MoEFeedForward`; returns (x, aux loss)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        d_ff: int,
        num_experts: int,
        capacity: int,
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
        self.moe = MoEFeedForward(
            d_model, d_ff, num_experts, capacity, out_std=out_std, dtype=dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.ln1(x))  # (batch, seq, embed)
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoETransformer(nnx.Module):
    def __init__(self, config: Config, *, rngs: layers.Keys):
        self.config = config
        c = config
        dt = jnp.dtype(c.dtype)
        self.embed = layers.Embeddings(c.vocab_size, c.seq_len, c.d_model, dtype=dt, rngs=rngs)
        out_std = gpt.residual_std(c.num_layers)
        blocks = []
        for i in range(c.num_layers):
            if is_moe_layer(c, i):
                blocks.append(
                    MoEBlock(
                        c.d_model, c.num_heads, c.head_dim, c.d_ff, c.num_experts, c.capacity,
                        out_std=out_std, dtype=dt, rngs=rngs,
                    )  # fmt: skip
                )
            else:
                blocks.append(
                    gpt.Block(
                        c.d_model, c.num_heads, c.head_dim, c.d_ff,
                        out_std=out_std, dtype=dt, rngs=rngs,
                    )  # fmt: skip
                )
        self.blocks = nnx.List(blocks)
        self.ln_f = layers.LayerNorm(c.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens int32 (batch, seq) -> (logits fp32 (batch, seq, vocab), mean aux loss)."""
        x = self.embed.encode(tokens)  # (batch, seq, embed)
        aux_losses = []
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                x, aux = block(x)
                aux_losses.append(aux)
            else:
                x = block(x)
        aux = jnp.mean(jnp.stack(aux_losses)) if aux_losses else jnp.zeros((), jnp.float32)
        return self.embed.decode(self.ln_f(x)), aux


def is_moe_layer(config: Config, index: int) -> bool:
    return index % config.moe_every == config.moe_every - 1


def create(config: Config, seed: int = 0) -> MoETransformer:
    """An MoE transformer with fp32 params from `seed` (pure; eager sharding off)."""
    with nnx.use_eager_sharding(False):
        return MoETransformer(config, rngs=layers.Keys(seed))


def make_batch(config: Config, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    return layers.lm_batch(config.vocab_size, config.seq_len, batch_size, seed)


def loss(model: MoETransformer, batch: dict[str, jax.Array]) -> jax.Array:
    """Next-token cross-entropy + aux_loss_coef * load-balancing loss (fp32)."""
    logits, aux = model(batch["inputs"])
    return layers.cross_entropy(logits, batch["targets"]) + model.config.aux_loss_coef * aux


def items_per_batch(config: Config, batch_size: int) -> int:
    return batch_size * config.seq_len
