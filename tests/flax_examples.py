"""Models and train steps written as Flax users write them (not the zoo): an NNX Transformer
LM with dropout and its own logical names, a Linen LM with logical partitioning and a
functional ``TrainState`` step with dropout, an NNX CNN with BatchNorm and Dropout. The tests
run their real steps, unchanged, through spmd."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

VOCAB, WIDTH, HEADS, SEQ, LAYERS = 64, 32, 4, 16, 2


# -- an NNX Transformer LM: dropout, logical names its rules map to the user's mesh axes ------
def _init(names):
    return nnx.with_partitioning(nnx.initializers.normal(0.02), names)


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            HEADS, WIDTH, kernel_init=_init(("embed", "heads", "kv")),
            out_kernel_init=_init(("heads", "kv", "embed")), decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, kernel_init=_init(("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, kernel_init=_init(("mlp", "embed")), rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.dropout(self.attn(self.norm1(x), mask=mask))
        return x + self.dropout(self.down(jax.nn.gelu(self.up(self.norm2(x)))))


class NnxLM(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=_init(("vocab", "embed")), rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, kernel_init=_init(("embed", "vocab")), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


#: the user's rules, naming the user's own mesh axes ("fsdp", "tensor"), MaxText-style lists
NNX_RULES = [["batch", "fsdp"], ["embed", "fsdp"], ["mlp", "tensor"], ["heads", "tensor"],
             ["vocab", "tensor"], ["kv", None]]


def with_adamw(model: nnx.Module):
    """The step's NNX arguments: the model and its AdamW optimizer."""
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def nnx_train_step(loss_fn):
    """The NNX train step Flax's examples write, for a loss ``(model, batch) -> scalar``."""
    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss}

    return train_step


def nnx_lm_state(seed: int = 0):
    return with_adamw(NnxLM(seed))


def nnx_lm_loss(model: NnxLM, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


nnx_lm_step = nnx_train_step(nnx_lm_loss)


def lm_batch(size: int = 8, seed: int = 0):
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (size, SEQ + 1), 0, VOCAB)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


# -- a Linen LM: nn.with_logical_partitioning, a functional TrainState step with dropout -------
def _linen_init(names):
    return nn.with_logical_partitioning(nn.initializers.normal(0.02), names)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.LayerNorm()(x)
        h = nn.SelfAttention(HEADS, kernel_init=_linen_init(("embed", "heads", "kv")),
                             out_kernel_init=_linen_init(("heads", "kv", "embed")),
                             deterministic=True)(h, mask=nn.make_causal_mask(x[..., 0]))
        x = x + nn.Dropout(0.1, deterministic=not train)(h)
        h = nn.Dense(4 * WIDTH, kernel_init=_linen_init(("embed", "mlp")))(nn.LayerNorm()(x))
        h = nn.Dense(WIDTH, kernel_init=_linen_init(("mlp", "embed")))(nn.gelu(h))
        return x + nn.Dropout(0.1, deterministic=not train)(h)


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(VOCAB, WIDTH, embedding_init=_linen_init(("vocab", "embed")))(tokens)
        for _ in range(LAYERS):
            x = LinenBlock()(x, train)
        return nn.Dense(VOCAB, kernel_init=_linen_init(("embed", "vocab")))(nn.LayerNorm()(x))


def linen_lm_state(seed: int = 0):
    """(TrainState of unboxed params, the params' logical PartitionSpecs as Flax gives them)."""
    model = LinenLM()
    boxed = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, SEQ), jnp.int32), train=False)
    state = train_state.TrainState.create(apply_fn=model.apply, params=nn.unbox(boxed)["params"],
                                          tx=optax.adamw(1e-3))
    return state, nn.get_partition_spec(boxed)["params"]


def linen_lm_step(state: train_state.TrainState, batch, dropout_key):
    key = jax.random.fold_in(dropout_key, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["tokens"], train=True,
                                rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def linen_lm_grads(params, batch, dropout_key):
    """The same loss's gradients, as a functional step of the params alone."""
    def loss_fn(p):
        logits = LinenLM().apply({"params": p}, batch["tokens"], train=True,
                                 rngs={"dropout": dropout_key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return jax.value_and_grad(loss_fn)(params)


# -- an NNX CNN with BatchNorm and Dropout (no sharding annotations, as the MNIST example) -----
class Cnn(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        # no bias before BatchNorm: its gradient is zero but for rounding, which AdamW's
        # normalization would turn into full-size updates of either sign
        self.conv1 = nnx.Conv(3, 16, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.fc = nnx.Linear(32 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
        return self.fc(self.dropout(x.reshape(x.shape[0], -1)))


def cnn_state(seed: int = 0):
    return with_adamw(Cnn(seed))


def cnn_loss(model: Cnn, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


cnn_step = nnx_train_step(cnn_loss)


def cnn_batch(size: int = 16, seed: int = 0):
    key1, key2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"image": jax.random.normal(key1, (size, 16, 16, 3)),
            "label": jax.random.randint(key2, (size,), 0, 10)}
