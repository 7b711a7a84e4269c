"""Sharding rules of ``jax.random``'s primitives: random bits made where they are used.

With ``jax_threefry_partitionable`` (on by default since jax 0.5), ``random_bits`` lowers to
a counter-based threefry over the output's element indices, so XLA partitions it like an
elementwise op: each device computes its own block of bits, no communication, and the
numbers are the same whatever the mesh (a dropout mask under a plan equals the one on one
device; tests/test_random.py). Its key stays replicated (8 bytes a key); the output takes
any spec. Without the flag the bits would depend on a sequential counter: then XLA computes
them whole on each device, and the rule offers only the replicated output.

The key operations (seed, fold_in, split, wrap, unwrap, clone) act on a few words; they are
replicated by rule, not listed as ops spmd could not shard.
"""

from __future__ import annotations

import math

import jax

from spmd.rules._core import RuleContext, Strategy, local_size, make, register
from spmd.sharding import replicated
from spmd.trace.graph import Op

#: threefry2x32 per 64 output bits: about 20 rounds of add, rotate, xor on two words
FLOPS_PER_ELEMENT = 30

KEY_OPS = ("random_seed", "random_fold_in", "random_split", "random_wrap", "random_unwrap",
           "random_clone")


def random_bits_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """The key replicated; the output in any spec (only replicated if bits are sequential).

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> jaxpr = jax.make_jaxpr(lambda k: jax.random.bits(k, (8, 4)))(jax.random.key(0))
    >>> eqn = [e for e in jaxpr.eqns if e.primitive.name == "random_bits"][0]
    >>> [s.name for s in random_bits_strategies(Op.from_eqn(eqn), RuleContext({"data": 2}))]
    ['- = RR', '- = RS(data)', '- = S(data)R']
    """
    shape = op.out_shapes[0]
    key = replicated(len(op.in_shapes[0]))
    specs = ctx.specs(shape) if jax.config.jax_threefry_partitionable else [replicated(len(shape))]
    return [make((key,), (spec,), (), FLOPS_PER_ELEMENT * local_size(shape, spec, ctx))
            for spec in specs]


def key_op_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Everything replicated: a key is two words."""
    ins = tuple(replicated(len(s)) for s in op.in_shapes)
    outs = tuple(replicated(len(s)) for s in op.out_shapes)
    return [make(ins, outs, (), FLOPS_PER_ELEMENT * sum(math.prod(s) for s in op.out_shapes))]


register(("random_bits",), random_bits_strategies)
register(KEY_OPS, key_op_strategies)
