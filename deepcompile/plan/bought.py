"""What each pass bought: the predicted step, exposed communication and peak after every pass of a
pass list, on a recorded run.

A plan is a list of passes; the what-if (:mod:`deepcompile.plan.whatif`) prices the whole list.
Here the same engine prices each prefix of it: after ``zero3`` alone (every parameter gathered
just before its use and freed after), then with ``prefetch``, then with ``selective_unshard``,
and so on. Each prefix runs with the parameters the whole list resolved to (``"auto"`` values
decided once, for the whole list), so a row differs from the one above it by exactly one pass
and the differences are what that pass bought: milliseconds of step and of exposed
communication, bytes of peak.

Exposed communication is the time a collective stream is busy while the compute stream is not,
in the predicted schedule (the part of the communication the step waits for); a wait for a
collective counts as idle compute.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from deepcompile.plan.record_base import BASE_PASS, load_base
from deepcompile.plan.whatif import WhatIf, _entries, _own_passes, predict_base
from deepcompile.profile.trace import intersection_length, union


@dataclass
class PassRow:
    after: str                 # the last pass of the prefix
    step_ms: float
    exposed_comm_ms: float
    comm_ms: float             # collective streams busy, overlapped or not
    peak_bytes: int
    peak_where: str

    def to_dict(self) -> dict:
        return asdict(self)


def _waits(e: dict) -> bool:
    """A compute-stream event that is a wait for a collective (the estimate puts the stall on the
    compute stream): idle compute, not work."""
    node = str(e.get("node", ""))
    return "wait" in node or node.startswith("end_backward")


def exposed_comm_ms(schedule: list[dict]) -> tuple[float, float]:
    """(exposed, total) ms of communication in a predicted schedule: the union of the collective
    streams' busy intervals, and the part of it the compute stream is idle for. Graphs run one
    after the other, so each graph's timeline (its own time base) is measured apart."""
    by_graph: dict = {}
    for e in schedule:
        by_graph.setdefault((e["graph_id"], e["kind"]), []).append(e)
    exposed = total = 0.0
    for events in by_graph.values():
        compute = union([(e["start_ms"], e["end_ms"]) for e in events if e["stream"] == "compute" and not _waits(e)])
        comm = union([(e["start_ms"], e["end_ms"]) for e in events if e["stream"] != "compute"])
        busy = sum(b - a for a, b in comm)
        total += busy
        exposed += busy - intersection_length(comm, compute)
    return exposed, total


def _row(name: str, w: WhatIf) -> PassRow:
    exposed, total = exposed_comm_ms(w.schedule)
    return PassRow(name, round(w.step_ms, 3), round(exposed, 3), round(total, 3), int(w.peak_bytes), w.peak_where)


def pass_table(run_dir, passes=None, *, rank: int = 0, memory_limit_gib: float | None = None) -> list[PassRow]:
    """One row per pass of ``passes`` (default: the record's own list), from ``zero3`` on: the
    prediction of the list up to and including that pass. The last row is the whole list's
    prediction, the same numbers every other view shows for it."""
    base = load_base(run_dir, rank)
    passes = passes if passes is not None else _own_passes(base)
    if not passes:
        return []
    whole = predict_base(base, passes, memory_limit_gib=memory_limit_gib)
    names = [n for n, _ in _entries(passes)]
    # every prefix with the whole list's resolved parameters; passes the planner added to fit
    # (in whole.params but not in the list) are priced with the last row only
    entries = [{"name": n, "params": dict(whole.params.get(n, {}))} for n in names]
    start = names.index(BASE_PASS)
    # rows in the order of what each adds to the ZeRO-3 graphs: zero3 and the passes after it,
    # then those that rewrite before it (recompute_activations), each row the list so far in
    # the list's own order
    order = names[start:] + names[:start]
    rows = []
    for i in range(len(order) - 1):
        upto = set(order[: i + 1])
        w = predict_base(base, [e for e in entries if e["name"] in upto], memory_limit_gib=memory_limit_gib)
        rows.append(_row(order[i], w))
    rows.append(_row(order[-1], whole))
    return rows


def table_lines(rows: list[PassRow]) -> list[str]:
    """The table as text (``deepcompile inspect``): one line per pass, with what it changed."""
    from deepcompile.vocab.memory import fmt_bytes

    out = [f"  {'after':<20}{'step':>11}{'exposed comm':>15}{'peak':>12}   change"]
    prev = None
    for r in rows:
        change = ""
        if prev is not None:
            change = (f"step {r.step_ms - prev.step_ms:+.1f} ms, exposed {r.exposed_comm_ms - prev.exposed_comm_ms:+.1f} ms, "
                      f"peak {'+' if r.peak_bytes >= prev.peak_bytes else '-'}{fmt_bytes(abs(r.peak_bytes - prev.peak_bytes))}")
        out.append(f"  {r.after:<20}{r.step_ms:>8.1f} ms{r.exposed_comm_ms:>12.1f} ms{fmt_bytes(r.peak_bytes):>12}   {change}")
        prev = r
    return out
