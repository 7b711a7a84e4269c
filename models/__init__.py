"""The `spmd` model zoo: Flax NNX models whose every parameter carries logical axis names.

Installed as ``spmd.zoo`` (from the repository's ``models/`` folder), so it never shadows a
user's own ``models`` package.

>>> from spmd import zoo
>>> spec = zoo.get("mlp-tiny")
>>> spec.family, spec.unit, spec.default_batch_size
('mlp', 'samples', 16)
>>> spec.param_count()
66176

A registered name is "<family>-<size>": gpt-{tiny,125m,350m,760m,1.3b,2.6b,6.7b,13b},
mlp-{tiny,small}, moe-{tiny,small}, wresnet-{tiny,small}. `ModelSpec.with_config` changes
any config field (`num_layers=48`, `dtype="bfloat16"`) for benchmarks; a GPT's
`remat="save_dots"` (or `"recompute_all"`) puts a `jax.checkpoint` with that policy around
each block, as a user writes it (spmd keeps a step's own checkpoints).

Logical axis names (read with `nnx.get_partition_spec(nnx.state(model))`; the optimizer
state made by `spec.optimizer` carries the same names as its param):

    batch     data only: dim 0 of every array in a batch
    embed     model width: d_model of transformers and of the MLP, LayerNorm scale/bias
    mlp       FFN hidden width (dense FFNs, each expert's FFN, the MLP's hidden layers)
    heads     attention heads
    kv        per-head width (head_dim) of q/k/v and of the attention output projection
    vocab     token-embedding rows (also the tied output projection)
    pos       position-embedding rows
    expert    the experts of an MoE layer (router columns, expert weights' dim 0)
    conv_in   a conv kernel's input channels, the classifier's input features
    conv_out  a conv kernel's output channels, BatchNorm scale/bias/statistics
    classes   the classifier's output
    layers    the stacked layer dim of a scanned GPT (`gpt.Config.scan_layers`); no
              hand-written plan (`spmd.manual`) has a rule for it, so they leave it unsplit

Per parameter kind:

    GPT / MoE token embedding    (vocab, embed)      position embedding (pos, embed)
    q/k/v kernel                 (embed, heads, kv)  q/k/v bias         (heads, kv)
    attention out kernel         (heads, kv, embed)  out bias           (embed,)
    FFN in kernel / bias         (embed, mlp) / (mlp,)
    FFN out kernel / bias        (mlp, embed) / (embed,)
    LayerNorm scale / bias       (embed,)
    MoE router                   (embed, expert)
    MoE expert in / out          (expert, embed, mlp) / (expert, mlp, embed)
    MLP even / odd layer kernel  (embed, mlp) / (mlp, embed), biases (mlp,) / (embed,)
    WRN conv kernel              (None, None, conv_in, conv_out); the RGB stem has
                                 (None, None, None, conv_out): 3 channels are not a
                                 model dim and never divide by 8
    WRN BatchNorm scale/bias/mean/var  (conv_out,)
    WRN classifier kernel / bias (conv_in, classes) / (classes,)

Every model unrolls its layers by default (a Python loop over an `nnx.List`), so no param
has a layer dim. `with_config(scan_layers=True)` on a GPT instead builds its blocks as one
stack under `nnx.vmap` and runs them with `nnx.scan` (the traced step holds one block
body, not one copy per layer): each block param gains a leading `layers` dim and keeps
its other names, e.g. the q kernel is (layers, embed, heads, kv), and so do its Adam
moments. The param count is the same either way.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from . import gpt, mlp, moe, train, wide_resnet

__all__ = ["ModelSpec", "UnknownModelError", "get", "names"]


class UnknownModelError(ValueError):
    """Raised by `get` for a name that is not registered; the message lists valid names."""


@dataclasses.dataclass(frozen=True)
class _Family:
    """What the registry needs from a model module (`spmd.zoo.gpt` etc.)."""

    name: str
    module: types.ModuleType


# Family name -> module; the order here is the order of `names()`.
_FAMILIES: dict[str, _Family] = {
    f.name: f
    for f in (
        _Family("gpt", gpt),
        _Family("mlp", mlp),
        _Family("moe", moe),
        _Family("wresnet", wide_resnet),
    )
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model: its config plus the functions that build, feed and train it.

    Every method is pure in its arguments (no global state), so `spmd` can call `create`
    under `nnx.eval_shape` to plan and again under a sharded `jax.jit` to initialize.
    """

    name: str
    family: str
    config: Any  # the family module's frozen `Config`
    default_batch_size: int

    @property
    def _module(self) -> types.ModuleType:
        return _FAMILIES[self.family].module

    @property
    def unit(self) -> str:
        """What `items_per_batch` counts: "tokens" or "samples"."""
        return self._module.UNIT

    def items_per_batch(self, batch_size: int) -> int:
        """Tokens (batch * seq) or samples in a batch of `batch_size` examples."""
        return self._module.items_per_batch(self.config, batch_size)

    def create(self, seed: int = 0) -> nnx.Module:
        """The model with fp32 params initialized from `seed`."""
        return self._module.create(self.config, seed)

    def training_state(self, seed: int = 0) -> tuple[nnx.Module, nnx.Optimizer]:
        """The model (from `seed`) and its AdamW optimizer: `train_step`'s first arguments.
        Under `nnx.eval_shape` nothing is allocated."""
        model = self.create(seed)
        return model, self.optimizer(model)

    def batch(self, batch_size: int | None = None, seed: int = 0) -> dict[str, jax.Array]:
        """A deterministic synthetic batch; dim 0 of every array is the batch dim."""
        size = self.default_batch_size if batch_size is None else batch_size
        return self._module.make_batch(self.config, size, seed)

    @property
    def loss(self) -> Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]:
        """`loss(model, batch)` -> scalar fp32 mean loss."""
        return self._module.loss

    def optimizer(self, model: nnx.Module, **adamw_overrides: float) -> nnx.Optimizer:
        """AdamW over the model's params (see `spmd.zoo.train.make_optimizer` for defaults)."""
        return train.make_optimizer(model, **adamw_overrides)

    def train_step(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]
    ) -> dict[str, jax.Array]:
        """One AdamW step; returns {"loss": ...}. Plain (not jitted): `spmd` wraps it."""
        return train.train_step(self._module.loss, model, optimizer, batch)

    def abstract_model(self) -> nnx.Module:
        """The model with `jax.ShapeDtypeStruct` leaves; nothing is allocated."""
        return nnx.eval_shape(lambda: self.create())

    def param_count(self) -> int:
        """Number of parameters (BatchNorm statistics excluded), without materializing."""
        params = nnx.state(self.abstract_model(), nnx.Param)
        return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))

    def with_config(self, **overrides: Any) -> ModelSpec:
        """A copy with config fields replaced, e.g. `with_config(num_layers=48, dtype="bfloat16")`.

        The name stays the registered one; `config` tells the variants apart.
        """
        fields = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"{self.name} has no config field(s) {unknown}; fields: {sorted(fields)}"
            )
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **overrides))


def _build_registry() -> dict[str, ModelSpec]:
    specs = {}
    for family in _FAMILIES.values():
        for size, config in family.module.SIZES.items():
            name = f"{family.name}-{size}"
            specs[name] = ModelSpec(
                name=name,
                family=family.name,
                config=config,
                default_batch_size=family.module.DEFAULT_BATCH_SIZES[size],
            )
    return specs


# Built once at import from the modules' constant tables; never mutated.
_REGISTRY: types.MappingProxyType[str, ModelSpec] = types.MappingProxyType(_build_registry())


def names() -> list[str]:
    """Every registered model name, family by family, smallest size first."""
    return list(_REGISTRY)


def get(name: str) -> ModelSpec:
    """The `ModelSpec` registered as `name`; `UnknownModelError` lists the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; valid names: {', '.join(_REGISTRY)}"
        ) from None
