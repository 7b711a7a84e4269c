"""The SPMD pipeline runtime: a step whose layers are one scanned stack (``nnx.scan``,
``lax.scan`` over stacked parameters) runs as one jitted program on the whole mesh, the
stack's layers spread over the ``stage`` axis and the microbatches flowing between stages by
collective-permute. This is MaxText's pipeline, made from the user's step as written: the
step's own forward and backward scans over the stack are each replaced by a loop over
microbatch ticks, so no model code changes.

The step is traced at one microbatch (as for the MPMD runtime, ``spmd.runtime.pipeline``)
and seen in parts (``spmd.stages.stack``): ``before`` the stack, the forward stack,
``between``, the backward stack, ``after``, and the ``update``. ``before``, ``between`` and
``after`` run microbatch by microbatch (a loop): what later microbatch work reads is kept
per microbatch, what only the update reads is summed as it goes.

Each stack runs as a pipeline: layer ``l`` belongs to chunk ``l // (L / (p v))`` and chunk
``c`` to stage ``c % p`` (``v`` repeats: the circular schedule; ``v = 1``: GPipe). At tick
``t`` the stage at position ``q`` along the flow (the first stage for the forward stack, the
last for the backward one) works on step ``k = t - q`` of its queue: microbatch ``k % m`` in
repeat ``k // m``. All stages run the same chunk program at once, vmapped over a leading
stage axis that the mesh's ``stage`` axis shards, so each device runs only its own stage;
then every stage's carry moves one stage along the flow (a collective-permute). ``m v + p -
1`` ticks; the idle ticks compute on clamped indices and their results are dropped. With
``v > 1`` the first stage keeps what comes back around the ring until its microbatch's next
repeat (``m >= p`` needed). Each part runs under its intra-op plan's sharding constraints
(``RegionLayout``; a stack's body under the stage vmap, so each stage keeps its own part).

The stack's per-layer values keep a stage layout, ``[p, v, L / (p v), ...]`` (per
microbatch ``[p, m, v, L / (p v), ...]``): the forward stack's saved values stay on the
stage that made them for the backward stack, and the parameters' gradients are summed over
the microbatches on the stage that holds the layer.

The update reads the microbatch phase's values averaged over the microbatches (exact for a
mean loss, as in the MPMD runtime). Microbatch ``j`` is rows ``j, j + m, j + 2m, ...`` of
the batch: each data-parallel device keeps its own rows, with no exchange.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from spmd.errors import PlanError
from spmd.runtime.compile import Executable, jit_step
from spmd.runtime.constrain import constrained, constraint_hooks
from spmd.sharding import Spec, spread, to_partition_spec
from spmd.stages.stack import RegionLayout, StackedStep, ticks
from spmd.trace.graph import SCAN, Scan, Value, value_key
from spmd.trace.interpret import eval_jaxpr_with

__all__ = ["StackedPipeline", "stacked_executable"]

# how a value is held inside the program
SHARED = "shared"        # one value for all microbatches, as the step has it
MICRO = "micro"          # [m, ...]: one per microbatch
STAGED = "staged"        # [p, v, Lc, ...]: a per-layer value in stage layout
STAGED_MICRO = "staged micro"  # [p, m, v, Lc, ...]
STAGED_SUM = "staged sum"      # [p, v, Lc, ...] summed over microbatches
RECOMPUTED = "recomputed"      # a saved value not kept: the backward tick makes it again


@dataclasses.dataclass(frozen=True)
class _Literal:
    """A literal a stack's scan reads (a scalar carry that starts at 0.0)."""

    value: Any


class _Replay:
    """The forward stack as the backward one runs a chunk of it again (recompute): its layer
    body, per-microbatch constants and per-layer inputs, and what entered each chunk."""

    def __init__(self, body, consts, xs, entered, chunk: int, num_carry: int):
        self.body, self.consts, self.chunk, self.num_carry = body, consts, chunk, num_carry
        self.xs = xs
        #: what the backward loop's stage vmap hands each stage: its share of these
        self.arrays = [entered, [x for x, _ in xs]]

    def __call__(self, arrays, j, rep) -> dict[int, tuple[Any, None]]:
        """Chunk ``rep`` of microbatch ``j`` on one stage, run forward again from what
        entered it: every per-layer result, by its index, as ``[layer of the chunk, ...]``."""
        entered, xs = arrays
        consts = [x[j] if has else x for x, has in self.consts]
        sources = [(x, has) for x, (_, has) in zip(xs, self.xs)]

        def layer(carry, i):
            outs = self.body(*consts, *carry,
                             *[x[j, rep, i] if has else x[rep, i] for x, has in sources])
            return list(outs[:self.num_carry]), list(outs[self.num_carry:])

        _, ys = jax.lax.scan(layer, [e[j, rep] for e in entered],
                             jnp.arange(self.chunk, dtype=jnp.int32))
        return {k: (y, None) for k, y in enumerate(ys)}


class StackedPipeline:
    """A ``StackedStep`` as one program over the whole batch: ``microbatches`` per step,
    ``stages`` along mesh axis ``stage_axis``, ``repeats`` chunks per stage; ``layouts``,
    ``recompute``: see the attributes."""

    def __init__(self, step: StackedStep, *, microbatches: int, stages: int, repeats: int,
                 stage_axis: str, layouts: Mapping[str, RegionLayout] | None = None,
                 recompute: bool = False):
        step.check(microbatches, stages, repeats)
        self.step = step
        self.graph, self.stack, self.phase = step.graph, step.stack, step.phase
        self.varies, self.parts, self.batch_inputs = step.varies, step.parts, step.batch_inputs
        m, p, v = microbatches, stages, repeats
        self.m, self.p, self.v, self.chunk = m, p, v, step.stack.length // (p * v)
        self.ticks = ticks(m, v, p)
        self.stage_axis = stage_axis
        #: per part ("before", "between", "after", "update", "forward stack",
        #: "backward stack"), how its plan lays it out (none: as XLA propagates)
        self.layouts = dict(layouts or {})
        self.mesh: jax.sharding.Mesh | None = None  # set by ``function``
        #: the forward stack keeps of its saved values only what each chunk started from,
        #: and the backward tick runs the chunk's forward again first (GPipe's remat)
        self.recompute = recompute
        self._replay: _Replay | None = None

    # -- the program ---------------------------------------------------------------------
    def function(self, mesh: jax.sharding.Mesh) -> Callable[..., list[Any]]:
        """The step over the whole batch on ``mesh``: flat leaves in, flat outputs out
        (jit it)."""
        graph = self.graph
        self.mesh = mesh

        def step(*leaves):
            env: dict[Value, tuple[Any, str]] = {}
            for i, node_id in enumerate(graph.inputs):
                x = leaves[i]
                if i in self.batch_inputs:
                    rows = x.shape[0]
                    x = jnp.swapaxes(x.reshape(rows // self.m, self.m, *x.shape[1:]), 0, 1)
                    env[Value(node_id, 0)] = (x, MICRO)
                else:
                    env[Value(node_id, 0)] = (x, SHARED)
            self._run_micro("before", env)
            self._run_stack(self.stack.forward, env, forward=True)
            self._run_micro("between", env)
            self._run_stack(self.stack.backward, env, forward=False)
            self._run_micro("after", env)
            if "update" in self.parts:
                region = self.parts["update"]
                outs = self._program("update")(*[self._shared(v, env) for v in region.inputs])
                for v, x in zip(region.outputs, outs):
                    env[v] = (x, SHARED)
            out = []
            for k, v in enumerate(graph.outputs):
                out.append(graph.output_literals[k] if v is None else self._shared(v, env))
            return out

        return step

    def _read(self, v: Value | _Literal, env: dict) -> tuple[Any, str]:
        if isinstance(v, _Literal):  # a scan operand the step wrote as a literal
            return jnp.asarray(v.value), SHARED
        if v not in env:  # a constant of the step
            node = self.graph.nodes[v.node]
            if v.node not in self.graph.constants:
                raise PlanError(f"the stacked pipeline has no value for node {v.node} "
                                f"({node.key}, {node.kind})")
            env[v] = (jnp.asarray(self.graph.constants[v.node]), SHARED)
        return env[v]

    def _shared(self, v: Value, env: dict) -> Any:
        """``v`` as the update reads it: averaged over the microbatches."""
        x, kind = self._read(v, env)
        if kind == SHARED:
            return x
        if kind == MICRO:
            return jnp.mean(x, axis=0)
        if kind == STAGED_SUM:
            return self._unstage(x) / self.m
        if kind == STAGED:
            return self._unstage(x)
        if kind == STAGED_MICRO:
            return jnp.mean(self._unstage_micro(x), axis=0)
        raise PlanError(f"the stacked pipeline made {v} again only for the backward stack, "
                        f"yet something else reads it")

    def _micro(self, v: Value, env: dict) -> tuple[Any, bool]:
        """``v`` as a microbatch region reads it: (value, whether it has a microbatch
        axis)."""
        x, kind = self._read(v, env)
        if kind in (SHARED, MICRO):
            return x, kind == MICRO
        if kind == STAGED_MICRO:
            return self._unstage_micro(x), True
        return self._shared(v, env), False

    def _run_micro(self, name: str, env: dict) -> None:
        """Run region ``name`` for each microbatch in turn (a scan over them). A result a
        later microbatch region or stack reads is kept per microbatch; one only the update
        or the step's result reads is summed as it goes (a gradient, the loss); one no
        microbatch changes is kept once."""
        if name not in self.parts:
            return
        region = self.parts[name]
        fn = self._program(name)
        read = [self._micro(v, env) for v in region.inputs]
        kept = [self.step.kept_per_microbatch(v) if self.varies[v.node] else None
                for v in region.outputs]
        avals = [jax.ShapeDtypeStruct(self.graph.value_shape(v), self.graph.value_dtype(v))
                 for v in region.outputs]

        def one(carry, j):
            outs = fn(*[x[j] if has else x for x, has in read])
            carry = [c if keep else o if keep is None else c + o
                     for c, o, keep in zip(carry, outs, kept)]
            return carry, [o for o, keep in zip(outs, kept) if keep]

        init = [jnp.zeros(a.shape, a.dtype) for a in avals]
        carry, per_micro = jax.lax.scan(one, init, jnp.arange(self.m, dtype=jnp.int32))
        per_micro = iter(per_micro)
        for v, c, keep in zip(region.outputs, carry, kept):
            if keep:
                env[v] = (next(per_micro), MICRO)
            elif keep is None:
                env[v] = (c, SHARED)
            else:
                env[v] = (c / self.m, SHARED)  # the average, as the update reads it

    def _program(self, name: str) -> Callable[..., list[Any]]:
        """Part ``name``'s program, under its plan's sharding constraints where it has one."""
        layout = self.layouts.get(name)
        if layout is None:
            return jaxpr_as_fun(self.parts[name].program())
        return constrained(layout.program, layout.constraints, self.mesh)

    # -- stage layout ----------------------------------------------------------------------
    def _stage(self, x: Any) -> Any:
        """[L, ...] -> [p, v, Lc, ...]: layer ``(r p + s) Lc + i`` at ``[s, r, i]``."""
        p, v, c = self.p, self.v, self.chunk
        return jnp.swapaxes(x.reshape(v, p, c, *x.shape[1:]), 0, 1)

    def _unstage(self, x: Any) -> Any:
        return jnp.swapaxes(x, 0, 1).reshape(self.stack.length, *x.shape[3:])

    def _stage_micro(self, x: Any) -> Any:
        """[m, L, ...] -> [p, m, v, Lc, ...]."""
        p, v, c, m = self.p, self.v, self.chunk, self.m
        return jnp.transpose(x.reshape(m, v, p, c, *x.shape[2:]),
                             (2, 0, 1, 3, *range(4, x.ndim + 2)))

    def _unstage_micro(self, x: Any) -> Any:
        """[p, m, v, Lc, ...] -> [m, L, ...]."""
        y = jnp.transpose(x, (1, 2, 0, 3, *range(4, x.ndim)))
        return y.reshape(self.m, self.stack.length, *x.shape[4:])

    def _staged(self, v: Value, env: dict) -> tuple[Any, bool]:
        """A per-layer value in stage layout: (value, whether per microbatch)."""
        x, kind = self._read(v, env)
        if kind == STAGED:
            return x, False
        if kind == STAGED_MICRO:
            return x, True
        if kind == MICRO:
            return self._stage_micro(x), True
        return self._stage(x), False

    def _constrain(self, x: Any, lead: int, inner: Spec | None) -> Any:
        """A stage-stacked array: its leading axis over the stage axis, ``lead`` more
        axes (microbatches, repeats, a chunk's layers) whole, the rest as the stack's
        intra-op plan puts them (``inner``; None: as XLA propagates)."""
        rest = x.ndim - 1 - lead
        if inner is None:
            tail = [PartitionSpec.UNCONSTRAINED] * rest
        else:
            tail = list(to_partition_spec(inner)) + [None] * rest
        spec = PartitionSpec(self.stage_axis, *[None] * lead, *tail[:rest])
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _shift(self, x: Any, forward: bool) -> Any:
        """Every stage's value to the next stage along the flow (the last one's to the first):
        one collective-permute over the stage axis."""
        p, axis = self.p, self.stage_axis
        perm = [(s, (s + 1) % p) if forward else (s, (s - 1) % p) for s in range(p)]
        spec = PartitionSpec(axis)
        moved = jax.shard_map(lambda y: jax.lax.ppermute(y, axis, perm), mesh=self.mesh,
                              in_specs=spec, out_specs=spec, axis_names=frozenset({axis}))
        return moved(x)

    # -- one stack as a pipeline ---------------------------------------------------------------
    def _run_stack(self, scan: Scan, env: dict, forward: bool) -> None:
        eqn = scan.eqn
        operands = [v if v is not None else _Literal(var.val)
                    for v, var in zip(scan.operands, eqn.invars)]
        m, p, v, c = self.m, self.p, self.v, self.chunk
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        reverse = bool(eqn.params["reverse"])
        layout = self.layouts.get("forward stack" if forward else "backward stack")
        operand_specs = list(layout.operands) if layout else [None] * len(scan.operands)
        result_specs = list(layout.results) if layout else [None] * len(scan.results)
        body = self._body(scan, layout)
        per_layer = lambda spec: None if spec is None else spec[1:]  # noqa: E731 (no L dim)
        consts = [self._micro(x, env) for x in operands[:nc]]
        inits = [self._micro(x, env) for x in operands[nc:nc + nk]]
        # per-layer inputs: an array in stage layout (and whether per microbatch), or the
        # index of a forward result the backward tick makes again (recompute)
        xs: list[tuple[Any, bool] | int] = []
        for x, spec in zip(operands[nc + nk:], operand_specs[nc + nk:]):
            kind = self._read(x, env)[1]
            if kind == RECOMPUTED:
                xs.append(self._read(x, env)[0])
                continue
            staged, has = self._staged(x, env)
            if kind in (STAGED, STAGED_MICRO):  # the forward stack's, kept as it made them:
                xs.append((staged, has))        # each layer's slice moves alone
            else:
                xs.append((self._constrain(staged, 3 if has else 2, per_layer(spec)), has))
        arrays = [x for x in xs if not isinstance(x, int)]
        replay = self._replay if not forward and any(isinstance(x, int) for x in xs) else None
        carry_avals = [var.aval for var in eqn.outvars[:nk]]
        ys_avals = [var.aval for var in eqn.outvars[nk:]]
        ys_values = list(scan.results[nk:])
        modes = [self._ys_mode(y, forward) for y in ys_values]
        kept = [k for k, mode in enumerate(modes) if mode != RECOMPUTED]

        # the loops' state, each with how it is laid out: (lead axes, spec of the rest)
        carry_specs = result_specs[:nk]
        # a carry crosses in pieces no two devices of a stage share, and is gathered there
        # (Megatron's scatter-gather; ``spmd.sharding.spread``)
        inside = {a: n for a, n in self.mesh.shape.items() if a != self.stage_axis}
        send_specs = [None if spec is None else spread(spec, a.shape, inside)
                      for spec, a in zip(carry_specs, carry_avals)]
        box_layout = [(0, spec) for spec in carry_specs]
        held_layout = [(1, spec) for spec in carry_specs]
        ring_layout = held_layout if v > 1 else []
        bufs_layout = [(3, per_layer(result_specs[nk + k])) if modes[k] == STAGED_MICRO
                       else (2, per_layer(result_specs[nk + k])) for k in kept]
        # recompute: what enters each chunk, per microbatch and repeat, for the backward
        entered_layout = [(2, spec) for spec in carry_specs] if (
            forward and RECOMPUTED in modes) else []

        def laid_out(arrays, layout):
            return [self._constrain(a, lead, spec) for a, (lead, spec) in zip(arrays, layout)]

        inbox = laid_out([jnp.zeros((p, *a.shape), a.dtype) for a in carry_avals], box_layout)
        held = laid_out([jnp.zeros((p, m, *a.shape), a.dtype) for a in carry_avals],
                        held_layout)  # the exit's results
        ring = laid_out([jnp.zeros((p, m, *a.shape), a.dtype) for a in carry_avals],
                        ring_layout) if v > 1 else []
        ys_bufs = laid_out([jnp.zeros((p, m, v, c, *ys_avals[k].shape[1:])
                                      if modes[k] == STAGED_MICRO
                                      else (p, v, c, *ys_avals[k].shape[1:]), ys_avals[k].dtype)
                            for k in kept], bufs_layout)
        entered = laid_out([jnp.zeros((p, m, v, *a.shape), a.dtype) for a in carry_avals],
                           entered_layout)
        stage_ids = self._constrain(jnp.arange(p, dtype=jnp.int32), 0, None)

        def chunk(cs, carry, read, bufs, j, rep, valid):
            """One stage's chunk for microbatch ``j``: its layers in turn, each reading its
            own slice of the per-layer inputs (``read(i)``) and writing its results in place
            (slicing the chunk's share out first would copy it: a microbatch's saved values,
            again)."""
            def layer(state, i):
                cr, bufs = state
                outs = body(*cs, *cr, *read(i))
                new = []
                for buf, k in zip(bufs, kept):
                    y, mode = outs[nk + k], modes[k]
                    if mode == STAGED_MICRO:
                        new.append(buf.at[j, rep, i].set(jnp.where(valid, y, buf[j, rep, i])))
                    elif mode == STAGED_SUM:
                        new.append(buf.at[rep, i].add(jnp.where(valid, y, jnp.zeros_like(y))))
                    else:
                        new.append(buf.at[rep, i].set(jnp.where(valid, y, buf[rep, i])))
                return (list(outs[:nk]), new), None

            order = jnp.arange(c - 1, -1, -1) if reverse else jnp.arange(c)
            (carry, bufs), _ = jax.lax.scan(layer, (list(carry), list(bufs)),
                                            order.astype(jnp.int32))
            return carry, bufs

        def stage_tick(s, box, held_s, ring_s, bufs, entered_s, xs_s, replayed_s, t):
            pos = s if forward else p - 1 - s
            k = t - pos
            valid = (k >= 0) & (k < m * v)
            kc = jnp.clip(k, 0, m * v - 1)
            r, j = kc // m, kc % m
            rep = r if forward else v - 1 - r
            entry, leave = pos == 0, pos == p - 1
            if v > 1:  # the first stage keeps what came around the ring for its next repeat
                came = t - p
                keep = entry & (came >= 0) & (came // m < v - 1)
                slot = jnp.clip(came, 0, m * v - 1) % m
                ring_s = [jnp.where(keep, buf.at[slot].set(b), buf) for buf, b in zip(ring_s, box)]
            fresh = [x[j] if has else x for x, has in inits]
            start = [jnp.where(entry, jnp.where(r == 0, f, ring_s[n][j]) if v > 1 else f, b)
                     for n, (f, b) in enumerate(zip(fresh, box))]
            entered_s = [e.at[j, rep].set(jnp.where(valid, x, e[j, rep]))
                         for e, x in zip(entered_s, start)]
            local = replay(replayed_s, j, rep) if replay is not None else []
            given = iter(xs_s)
            sources = [local[x] if isinstance(x, int) else (next(given), x[1]) for x in xs]

            def read(i):
                return [x[i] if has is None else x[j, rep, i] if has else x[rep, i]
                        for x, has in sources]

            cs = [x[j] if has else x for x, has in consts]
            out, new_bufs = chunk(cs, start, read, bufs, j, rep, valid)
            done = valid & leave & (r == v - 1)
            held_s = [h.at[j].set(jnp.where(done, o, h[j])) for h, o in zip(held_s, out)]
            return out, held_s, ring_s, new_bufs, entered_s

        replayed = replay.arrays if replay is not None else []

        def tick(state, t):
            box, held_, ring_, bufs, entered_ = state

            def one(s, box_s, held_s, ring_s, bufs_s, entered_s, xs_s, replayed_s):
                return stage_tick(s, box_s, held_s, ring_s, bufs_s, entered_s, xs_s,
                                  replayed_s, t)

            out, held_, ring_, bufs, entered_ = jax.vmap(one, spmd_axis_name=self.stage_axis)(
                stage_ids, box, held_, ring_, bufs, entered_, [x for x, _ in arrays],
                replayed)
            box = [self._shift(self._constrain(o, 0, piece), forward)
                   for o, piece in zip(out, send_specs)]
            return (laid_out(box, box_layout), laid_out(held_, held_layout),
                    laid_out(ring_, ring_layout), laid_out(bufs, bufs_layout),
                    laid_out(entered_, entered_layout)), None

        (box, held, ring, ys_bufs, entered), _ = jax.lax.scan(
            tick, (inbox, held, ring, ys_bufs, entered), jnp.arange(self.ticks, dtype=jnp.int32))
        exit_stage = p - 1 if forward else 0
        for res, h in zip(scan.results[:nk], held):
            if res is not None:
                env[res] = (h[exit_stage], MICRO)
        for k, buf in zip(kept, ys_bufs):
            if ys_values[k] is not None:
                env[ys_values[k]] = (buf, modes[k])
        if forward and entered:
            for k, res in enumerate(ys_values):
                if modes[k] == RECOMPUTED and res is not None:
                    env[res] = (k, RECOMPUTED)
            self._replay = _Replay(body, consts, xs, entered, c, nk)

    def _body(self, scan: Scan, layout: RegionLayout | None) -> Callable[..., list[Any]]:
        """One layer of ``scan``: its body, under the stack plan's constraints inside it
        and on the carry and the layer's slices it reads (the plan's paths: the scan's
        equation in its region's program, then the body's)."""
        closed = scan.eqn.params["jaxpr"]
        if layout is None:
            return jaxpr_as_fun(closed)
        at = next(i for i, e in enumerate(layout.program.jaxpr.eqns)
                  if e.primitive.name == SCAN)
        after, before = constraint_hooks(layout.constraints, self.mesh)
        nc, nk = scan.eqn.params["num_consts"], scan.eqn.params["num_carry"]
        entering = [value_key((at, "carry", k), 0) for k in range(nk)] + [
            value_key((at, "xs", k), 0) for k in range(len(scan.operands) - nc - nk)]

        def body(*args):
            args = list(args)
            args[nc:] = [self._pin(x, layout.constraints.get(key))
                         for x, key in zip(args[nc:], entering)]
            return eval_jaxpr_with(closed.jaxpr, closed.consts, args, after, before,
                                   path=(at,))

        return body

    def _pin(self, x: Any, spec: Spec | None) -> Any:
        """``x`` in ``spec`` on the mesh (under the stage vmap: each stage's own part)."""
        if spec is None:
            return x
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, to_partition_spec(spec)))

    def _ys_mode(self, y: Value | None, forward: bool) -> str:
        """How a stack's per-layer result is kept: not at all where the backward loop makes
        it again (recompute; ``StackedStep.recomputable``), per microbatch where a microbatch
        region or the backward stack reads it, summed where only the update (or the step's
        result) does, once where no microbatch changes it."""
        if forward and self.recompute and y is not None and self.step.recomputable(y):
            return RECOMPUTED
        if y is None or not self.varies[y.node]:
            return STAGED
        if not forward and not self.step.kept_per_microbatch(y):
            return STAGED_SUM
        return STAGED_MICRO


def stacked_executable(plan: Any, donate: bool | None = None,
                       compiler_options: Mapping[str, Any] | None = None) -> Executable:
    """A ``PipelinePlan`` of the SPMD runtime made runnable: its one program jitted on the
    whole mesh with the plan's shardings (``spmd.runtime.compile.jit_step``, the aliased
    state donated by default, as ``prepare`` does)."""
    pipeline = StackedPipeline(plan.stacked, microbatches=plan.microbatches,
                               stages=len(plan.stages), repeats=plan.repeats,
                               stage_axis=plan.stage_axis, layouts=plan.layouts,
                               recompute=plan.recompute)
    step = pipeline.function(plan.mesh.sharding_mesh())
    return jit_step(plan, lambda *flat: tuple(step(*flat)), donate, compiler_options)
