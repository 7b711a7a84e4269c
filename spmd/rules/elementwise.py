"""Sharding rules of elementwise primitives: operands and outputs share one spec.

Jaxprs make most broadcasting explicit, so an operand has the output's shape, is a scalar
(shape ``()``, replicated), or has the output's rank with size-1 dims where the output is
larger (``log_softmax`` binds ``sub`` of ``(B, S, V)`` and ``(B, S, 1)``): those dims stay
unsplit in that operand and the others follow the output. Each candidate output spec is
one strategy with no communication; one FLOP per output element a device computes. These
ops are *followers*: the graph builder may merge them with the producer of their main
operand instead of giving them their own solver variable.
"""

from __future__ import annotations

from spmd.rules._core import RuleContext, Strategy, UnsupportedPattern, local_size, make, register
from spmd.trace.graph import Op

UNARY = (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i0e", "bessel_i1e",
    "cbrt", "ceil", "clz", "conj", "cos", "cosh", "digamma", "erf", "erf_inv", "erfc", "exp",
    "exp2", "expm1", "floor", "imag", "integer_pow", "is_finite", "lgamma", "log", "log1p",
    "logistic", "neg", "not", "population_count", "real", "round", "rsqrt", "sign", "sin",
    "sinh", "sqrt", "square", "tan", "tanh",
    # convert-like: same shape, maybe another dtype
    "convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient",
    "bitcast_convert_type",
)
NARY = (
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "complex",
    "and", "or", "xor", "eq", "ne", "lt", "gt", "le", "ge", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "igamma", "igammac", "igamma_grad_a",
    "polygamma", "zeta", "regularized_incomplete_beta", "random_gamma_grad", "mulhi",
    "select_n", "clamp", "add_any", "threefry2x32",
)
ELEMENTWISE = UNARY + NARY


def elementwise_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """One strategy per candidate spec of the output; scalar operands replicated.

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> eqn = jax.make_jaxpr(lambda x: x * 2.0)(jnp.zeros((4, 8))).eqns[-1]
    >>> ss = elementwise_strategies(Op.from_eqn(eqn), RuleContext({"data": 2}))
    >>> [s.name for s in ss]
    ['RR x - = RR', 'RS(data) x - = RS(data)', 'S(data)R x - = S(data)R']
    """
    shape = op.out_shapes[0]
    if (any(s != shape for s in op.out_shapes)
            or not all(_broadcastable(s, shape) for s in op.in_shapes)):
        raise UnsupportedPattern(f"{op.primitive} operands of shapes {op.in_shapes} -> {shape}")
    out: list[Strategy] = []
    for spec in ctx.specs(shape):
        ins = tuple(tuple(a if n == m else () for a, n, m in zip(spec, s, shape)) if s else ()
                    for s in op.in_shapes)
        flops = local_size(shape, spec, ctx) * len(op.out_shapes)
        out.append(make(ins, (spec,) * len(op.out_shapes), (), flops))
    return out


def _broadcastable(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    return shape == () or (len(shape) == len(out) and all(n in (m, 1) for n, m in zip(shape, out)))


register(ELEMENTWISE, elementwise_strategies, follower=True)
# a copy to another memory (host offload): each device copies its own piece, so any spec;
# not a follower, as it is no part of its neighbours' kernel (priced by the cost graph at
# the host link)
register(("device_put",), elementwise_strategies)
