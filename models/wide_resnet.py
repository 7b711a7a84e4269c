"""Wide ResNet (Zagoruyko & Komodakis 2016) in Flax NNX.

WRN-d-k: a 3x3 stem conv, three stages of (d - 4) / 6 pre-activation residual blocks
(BN-ReLU-conv3x3-BN-ReLU-conv3x3) with 16k, 32k, 64k channels and strides 1, 2, 2, a
final BN-ReLU, global average pooling and a dense classifier. Alpa (Zheng et al. OSDI'22,
§8.1) uses it as the convolutional benchmark: its channels grow with depth, so the best
sharding changes from layer to layer.

BatchNorm always runs in training mode (batch statistics, running averages updated by
NNX state mutation), in the train step and in the loss alike, so a single-device run and
a sharded run compute the same numbers.

Batch: {"images": fp32 (batch, height, width, 3) NHWC, "labels": int32 (batch,)};
loss is the mean softmax cross-entropy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import layers

IMAGE_CHANNELS = 3


@dataclasses.dataclass(frozen=True)
class Config:
    image_size: int = 16  # square images, NHWC
    depth: int = 10  # 6n + 4 conv layers; 10 -> one block per stage
    widen_factor: int = 2  # k: stage widths are base_width * k * (1, 2, 4)
    base_width: int = 16  # also the stem's width (not widened, as in the paper)
    num_classes: int = 16
    bn_momentum: float = 0.9  # running-average decay; PyTorch's momentum=0.1
    dtype: str = "float32"

    def __post_init__(self):
        layers.check_positive(self, "image_size", "depth", "widen_factor", "base_width", "num_classes")
        if (self.depth - 4) % 6 or self.depth < 10:
            raise ValueError(f"wide_resnet.Config.depth must be 6n + 4 with n >= 1, got {self.depth}")
        object.__setattr__(self, "dtype", layers.canonical_dtype(self.dtype))

    @property
    def blocks_per_stage(self) -> int:
        return (self.depth - 4) // 6

    @property
    def stage_widths(self) -> tuple[int, int, int]:
        w = self.base_width * self.widen_factor
        return (w, 2 * w, 4 * w)


SIZES: dict[str, Config] = {
    "tiny": Config(),
    "small": Config(image_size=32, depth=16, widen_factor=4, num_classes=64),
}
DEFAULT_BATCH_SIZES: dict[str, int] = {"tiny": 8, "small": 64}
UNIT = "samples"


def _conv(
    c_in: int, c_out: int, kernel: int, stride: int, in_name: str | None, dtype, rngs: nnx.Rngs
) -> nnx.Conv:
    """Bias-free conv (a BatchNorm follows), kernel (kh, kw, conv_in, conv_out) with He init."""
    init = jax.nn.initializers.he_normal()
    return nnx.Conv(
        c_in,
        c_out,
        (kernel, kernel),
        strides=stride,
        padding="SAME",
        use_bias=False,
        kernel_init=nnx.with_partitioning(init, (None, None, in_name, "conv_out")),
        dtype=dtype,
        rngs=rngs,
    )


def _batch_norm(channels: int, momentum: float, dtype, rngs: nnx.Rngs) -> nnx.BatchNorm:
    """Training-mode BatchNorm whose scale, bias and statistics are all named ("conv_out",)."""
    names = ("conv_out",)
    bn = nnx.BatchNorm(
        channels,
        use_running_average=False,
        momentum=momentum,
        dtype=dtype,
        scale_init=nnx.with_partitioning(layers.ones, names),
        bias_init=nnx.with_partitioning(layers.zeros, names),
        rngs=rngs,
    )
    # flax creates the running statistics without metadata; re-create them with names.
    bn.mean = layers.named_variable(nnx.BatchStat, jnp.zeros((channels,), jnp.float32), names)
    bn.var = layers.named_variable(nnx.BatchStat, jnp.ones((channels,), jnp.float32), names)
    return bn


class WideBlock(nnx.Module):
    """Pre-activation residual block; a 1x1 conv shortcut where the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, momentum: float, *, dtype, rngs):
        self.bn1 = _batch_norm(c_in, momentum, dtype, rngs)
        self.conv1 = _conv(c_in, c_out, 3, stride, "conv_in", dtype, rngs)
        self.bn2 = _batch_norm(c_out, momentum, dtype, rngs)
        self.conv2 = _conv(c_out, c_out, 3, 1, "conv_in", dtype, rngs)
        needs_projection = c_in != c_out or stride != 1
        self.shortcut = (
            _conv(c_in, c_out, 1, stride, "conv_in", dtype, rngs) if needs_projection else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        o = jax.nn.relu(self.bn1(x))  # (batch, h, w, c_in)
        y = self.conv1(o)  # (batch, h/stride, w/stride, c_out)
        y = self.conv2(jax.nn.relu(self.bn2(y)))
        # Like the reference code, the projection shortcut reads the pre-activated input.
        return y + (self.shortcut(o) if self.shortcut is not None else x)


class WideResNet(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        dt = jnp.dtype(c.dtype)
        # The stem reads RGB: 3 input channels are no model dimension, so no logical name.
        self.stem = _conv(IMAGE_CHANNELS, c.base_width, 3, 1, None, dt, rngs)
        blocks = []
        c_in = c.base_width
        for stage, (width, stride) in enumerate(zip(c.stage_widths, (1, 2, 2))):
            for i in range(c.blocks_per_stage):
                blocks.append(
                    WideBlock(c_in, width, stride if i == 0 else 1, c.bn_momentum, dtype=dt, rngs=rngs)
                )
                c_in = width
        self.blocks = nnx.List(blocks)
        self.bn_f = _batch_norm(c_in, c.bn_momentum, dt, rngs)
        self.head = nnx.Linear(
            c_in,
            c.num_classes,
            kernel_init=nnx.with_partitioning(jax.nn.initializers.lecun_normal(), ("conv_in", "classes")),
            bias_init=nnx.with_partitioning(layers.zeros, ("classes",)),
            dtype=dt,
            rngs=rngs,
        )

    def __call__(self, images: jax.Array) -> jax.Array:
        """images fp32 (batch, h, w, 3) -> logits fp32 (batch, classes)."""
        x = self.stem(images.astype(jnp.dtype(self.config.dtype)))  # (batch, h, w, base_width)
        for block in self.blocks:
            x = block(x)
        x = jax.nn.relu(self.bn_f(x))  # (batch, h/4, w/4, 64k)
        x = x.mean(axis=(1, 2))  # global average pool: (batch, 64k)
        return self.head(x).astype(jnp.float32)  # (batch, classes)


def create(config: Config, seed: int = 0) -> WideResNet:
    """A WideResNet with fp32 params from `seed` (pure; eager sharding off)."""
    with nnx.use_eager_sharding(False):
        return WideResNet(config, rngs=nnx.Rngs(params=seed))


def make_batch(config: Config, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """N(0, 1) images and uniform labels; the model can only memorize them, which is
    enough for throughput and for checking that sharded and single-device runs agree."""
    k_img, k_lbl = jax.random.split(jax.random.key(seed))
    s = config.image_size
    images = jax.random.normal(k_img, (batch_size, s, s, IMAGE_CHANNELS), jnp.float32)
    labels = jax.random.randint(k_lbl, (batch_size,), 0, config.num_classes, jnp.int32)
    return {"images": images, "labels": labels}


def loss(model: WideResNet, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy (fp32); updates BatchNorm statistics as a side effect."""
    logits = model(batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def items_per_batch(config: Config, batch_size: int) -> int:
    return batch_size
