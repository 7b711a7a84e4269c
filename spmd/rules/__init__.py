"""Per-primitive sharding rules: the strategies of one op on a device mesh.

One module per primitive family fills :data:`REGISTRY` on import: ``dot_general``,
``elementwise``, ``broadcast`` (broadcast_in_dim, reshape, squeeze, transpose), ``reduce``,
``indexing`` (gather, scatter-add, slices, pad, concatenate, sort, ...), ``conv`` and
``window`` (pooling), ``loop`` (a scan's boundary pseudo-ops), ``random`` (random bits and
key operations). Ops with nested jaxprs
(pjit, custom_jvp_call, ...) have no rule: the graph builder inlines them (a scan's body is
planned once), and :func:`strategies` answers a replicated fallback for the rest (while,
cond).

>>> import jax, jax.numpy as jnp
>>> from spmd.rules import Op, RuleContext, strategies
>>> eqn = jax.make_jaxpr(jnp.matmul)(jnp.zeros((8, 16)), jnp.zeros((16, 32))).eqns[0]
>>> row = [s for s in strategies(Op.from_eqn(eqn), RuleContext({"data": 2, "model": 4}))
...        if s.name == "RS(model) x S(model)R = RR (all-reduce @ model)"][0]
>>> row.collectives[0].bytes, row.flops    # 8*32 f32 partial sums; 2*8*16*32/4
(1024.0, 2048.0)
"""

from spmd.rules._core import (
    MAX_STRATEGIES as MAX_STRATEGIES,
    REGISTRY as REGISTRY,
    Rule as Rule,
    RuleContext as RuleContext,
    RuleEntry as RuleEntry,
    Strategy as Strategy,
    UnsupportedPattern as UnsupportedPattern,
    fallback as fallback,
    has_rule as has_rule,
    is_follower as is_follower,
    register as register,
    spec_name as spec_name,
    strategies as strategies,
)
from spmd.trace.graph import Op as Op
from spmd.rules import (  # noqa: F401  (imported for their registrations)
    broadcast, conv, dot_general, elementwise, indexing, loop, random, reduce, window,
)

__all__ = [
    "MAX_STRATEGIES", "REGISTRY", "Op", "Rule", "RuleContext", "RuleEntry", "Strategy",
    "UnsupportedPattern", "fallback", "has_rule", "is_follower", "register", "spec_name",
    "strategies",
]
