"""A plan explained to a person: its input specs, how good the search's plan is, the
predicted cost beside every hand-written plan's, and predicted against compiled.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from spmd.cost.partitioner import COLLECTIVE_KINDS
from spmd.manual import DOES_NOT_APPLY
from spmd.sharding import bytes_per_device, format_spec

if TYPE_CHECKING:
    from spmd.plan import Plan

__all__ = ["describe", "emitted_by", "solver_summary"]


def describe(plan: "Plan", max_rows: int | None = 60) -> str:
    """A readable report of ``plan`` (``max_rows`` input rows at most; None: all)."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=120, record=False, force_terminal=False)
    console.print(f"plan: method={plan.method}  {plan.mesh.describe()}")
    console.print(_inputs_table(plan, max_rows))
    totals = plan.bytes_by_kind()
    console.print("state per device: " + ", ".join(f"{k} {v / 2**20:.2f} MiB"
                                                    for k, v in sorted(totals.items())))
    if plan.remat is not None and plan.remat.active:
        console.print(_remat_line(plan))
    if plan.offload is not None and plan.offload.active:
        console.print(_offload_line(plan))
    for note in (plan.search or {}).get("memory_notes") or ():
        console.print(note)
    if plan.search:
        summary = solver_summary(plan.search)  # the raw counters stay in the plan's JSON
        if summary:
            console.print(summary)
        timings, phases = plan.search.get("timings"), plan.search.get("phases")
        if timings:
            seconds = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in d.items())  # noqa: E731
            console.print("planning seconds: " + seconds(timings)
                          + (f" (search: {seconds(phases)})" if phases else ""))
        if plan.search.get("fallbacks"):
            console.print(f"replicated (no sharding rule): {plan.search['fallbacks']}")
    if plan.prediction or plan.alternatives:
        console.print(_prediction_table(plan))
    if plan.measured and plan.prediction:
        console.print(_measured_table(plan))
        if plan.measured.get("comm_time") is not None:
            unpriced = plan.measured.get("unpriced_collectives") or 0
            console.print(
                f"communication priced by the cost model: predicted "
                f"{plan.prediction.comm_time * 1e3:.3f} ms, the HLO's collectives "
                f"{plan.measured['comm_time'] * 1e3:.3f} ms (each priced alone, so an upper "
                f"bound where XLA combined them"
                + (f"; {unpriced} not priced: no whole-axis replica groups" if unpriced else "")
                + ")")
    elif plan.measured and plan.measured.get("memory"):
        console.print(f"compiled: peak {plan.measured['memory']['peak_bytes'] / 2**20:.2f} "
                      f"MiB per device")
    return buf.getvalue()


#: the input groups, in the order shown; the batch first, so it is never cut off
GROUPS = (("batch", "batch"), ("param", "parameters"), ("optimizer", "optimizer state"),
          ("state", "other state"))


def _inputs_table(plan: "Plan", max_rows: int | None):
    """The inputs grouped by kind: the batch whole, then at most ``max_rows`` rows shared by
    the other groups (each at least a few), each cut group saying how many it leaves out."""
    from rich.table import Table

    table = Table(title="inputs", show_lines=False)
    for col in ("tensor", "kind", "shape", "logical", "spec", "bytes/device"):
        table.add_column(col, justify="right" if col == "bytes/device" else "left")
    rows = list(zip(plan.leaves, plan.input_specs))
    groups = [(title, [r for r in rows if r[0].kind == kind]) for kind, title in GROUPS]
    groups = [(title, members) for title, members in groups if members]
    share = None if max_rows is None else max(3, max_rows // max(1, len(groups) - 1))
    for title, members in groups:
        shown = members if share is None or title == "batch" else members[:share]
        for leaf, spec in shown:
            logical = ",".join(n or "-" for n in leaf.logical) if leaf.logical else ""
            table.add_row(leaf.path, leaf.kind, str(leaf.shape), logical, format_spec(spec),
                          f"{bytes_per_device(leaf.shape, leaf.dtype, spec, plan.mesh.shape):,}")
        if len(members) > len(shown):
            table.add_row(f"... {len(members) - len(shown)} more {title}", "", "", "", "", "")
        table.add_section()
    return table


def _remat_line(plan: "Plan") -> str:
    """Which layers recompute what, and what it costs."""
    from spmd.memory.remat import POLICY_MEANING

    remat = plan.remat
    layers = [k for k, p in enumerate(remat.policies) if p is not None]
    policies = sorted({p for p in remat.policies if p is not None})
    span = (f"layers {layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1))
            else "layers " + ", ".join(map(str, layers)))
    line = (f"rematerialized: {remat.summary()} ({span}; "
            + "; ".join(f"{p}: {POLICY_MEANING[p]}" for p in policies) + ")")
    if plan.prediction is not None:
        line += (f", recompute {plan.prediction.recompute_time * 1e3:.3f} ms per step "
                 f"({plan.prediction.recompute_time / plan.prediction.total_time:.0%} of it)")
    probes = (plan.search or {}).get("remat_probes")
    if probes:
        line += f"; {len(probes)} searches to find it"
    return line


def _offload_line(plan: "Plan") -> str:
    """What lives in host memory between steps, and what moving it costs."""
    moved = plan.offload
    held = sum(bytes_per_device(plan.leaves[i].shape, plan.leaves[i].dtype,
                                plan.input_specs[i], plan.mesh.shape) for i in moved.inputs)
    line = (f"offloaded: {moved.summary(plan.leaves)}, {held / 2**20:.2f} MiB per device, "
            f"copied to the device for the update and back")
    if plan.prediction is not None:
        line += (f", {plan.prediction.transfer_time * 1e3:.3f} ms of copies per step over "
                 f"the {plan.mesh.device.host_bandwidth / 1e9:.4g} GB/s host link")
    return line


def solver_summary(search: dict) -> str | None:
    """How good the search's plan is: the objective against the proven lower bound.

    >>> solver_summary({"status": "feasible", "objective": 1.271, "bound": 0.0})
    'search: feasible in 0.00 s, 1271 ms per step predicted, no lower bound proven'
    """
    s = search or {}
    if s.get("objective") is None or s.get("bound") is None:
        return None
    objective, bound = s["objective"], s["bound"]
    gap = (objective - bound) / objective if objective > 0 else 0.0
    how = ("; stopped at the time limit" if s.get("timed_out")
           else "; stopped early, no better plan coming" if s.get("stalled") else "")
    kept = (f"; the hand-written plan {s['kept_hand_written']} scored better and is used"
            if s.get("kept_hand_written") else "")
    size = (f"; {s['graph_ops']:,} ops, {s['solver_nodes']:,} choices after merging"
            if s.get("graph_ops") is not None and s.get("solver_nodes") is not None else "")
    # (a search answered by its seeds alone, as the remat search's last is, proves no bound)
    quality = (f"within {gap:.2%} of the lower bound {bound * 1e3:.4g} ms "
               f"({s.get('bound_from', 'cp-sat')})" if bound > 0 else "no lower bound proven")
    return (f"search: {s.get('status')} in {s.get('search_seconds', 0):.2f} s, "
            f"{objective * 1e3:.4g} ms per step predicted, {quality}{size}{how}{kept}")


def _prediction_table(plan: "Plan"):
    from rich.table import Table

    table = Table(title="predicted cost per step (cost model)", caption_justify="left")
    entries = ([(f"{plan.method} (this plan)", plan.prediction)] if plan.prediction else [])
    entries += list(plan.alternatives.items())
    # a recompute (host copies) column only where some plan rematerializes (offloads)
    remat = any(not isinstance(p, str) and p is not None and p.recompute_time
                for _, p in entries)
    moves = any(not isinstance(p, str) and p is not None and p.transfer_time
                for _, p in entries)
    columns = ["plan", "compute ms", "memory-bound ms", "launch ms"]
    columns += ["recompute ms"] * remat + ["host copies ms"] * moves + [
        "comm ms", "total ms", "collective MiB", "memory MiB", "note"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("plan", "note") else "right",
                         no_wrap=col == "plan")
    # methods that do not apply: one line under the table per reason, not a row each
    skipped: dict[str, list[str]] = {}
    for name, pred in entries:
        if isinstance(pred, str) and pred.startswith(DOES_NOT_APPLY):
            skipped.setdefault(pred[len(DOES_NOT_APPLY):], []).append(name)
            continue
        if isinstance(pred, str) or pred is None:
            table.add_row(name, *[""] * (len(columns) - 2), pred or "")
            continue
        ms = lambda t: f"{t * 1e3:.3f}"  # noqa: E731
        table.add_row(name, ms(pred.compute_time), ms(pred.memory_time), ms(pred.launch_time),
                      *[ms(pred.recompute_time)] * remat, *[ms(pred.transfer_time)] * moves,
                      ms(pred.comm_time),
                      ms(pred.total_time), f"{pred.collective_bytes / 2**20:.3f}",
                      f"{pred.memory_bytes / 2**20:.2f}", "")
    captions = [f"{', '.join(names)}: does not apply: {why}" for why, names in skipped.items()]
    if plan.rewritten and plan.alternatives:
        captions.append("hand-written plans are priced on the step as written, without remat "
                        "or offload")
    if captions:
        table.caption = "\n".join(captions)
    return table


def emitted_by(measured: dict) -> str:
    """Whose collectives a measured record (``Report.record``) holds, and what was reconciled
    when a CPU compile stands in for a GPU mesh (``spmd.analysis.reconcile``).

    >>> emitted_by({"platform": "gpu", "reconciled": {"compiled_on": "cpu",
    ...             "reduce_scatters": 2, "promoted": 0}})
    'collectives as XLA:GPU emits them (CPU compile reconciled: 2 all-reduce+slice counted as reduce-scatter)'
    """
    platform = measured.get("platform")
    if not platform:
        return "collectives as compiled"
    text = f"collectives as XLA:{platform.upper()} emits them"
    done = measured.get("reconciled")
    if done:
        parts = [f"{done['reduce_scatters']} all-reduce+slice counted as reduce-scatter"]
        if done.get("promoted"):
            parts.append(f"{done['promoted']} f32-promoted all-reduce counted at its own width")
        text += f" ({done['compiled_on'].upper()} compile reconciled: {'; '.join(parts)})"
    return text


def _measured_table(plan: "Plan"):
    from rich.table import Table

    table = Table(title=f"predicted vs compiled HLO (per device; {emitted_by(plan.measured)}; "
                  "XLA may combine collectives, so compare bytes)")
    for col in ("kind", "pred count", "pred MiB", "HLO count", "HLO MiB"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    pred = plan.prediction.collectives
    meas = plan.measured["collectives"]
    for kind in COLLECTIVE_KINDS:
        pc, pb = pred.get(kind, (0, 0))
        mc, mb = meas.get(kind, (0, 0))
        if pc or mc:
            table.add_row(kind, str(pc), f"{pb / 2**20:.3f}", str(mc), f"{mb / 2**20:.3f}")
    if plan.measured.get("memory"):
        table.add_row("peak memory", "", f"{plan.prediction.memory_bytes / 2**20:.3f}", "",
                      f"{plan.measured['memory']['peak_bytes'] / 2**20:.3f}")
    return table
