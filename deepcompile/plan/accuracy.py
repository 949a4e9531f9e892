"""Where the cost model is wrong: predicted against measured time per node and per collective.

The record's schedule holds the measured step (the profiler's trace of one steady step, each
kernel or collective filed under the graph node that issued it); the what-if of the record's
own pass list predicts the same graphs node by node. Summed per node, the two say which nodes
and which collectives the model prices wrong, and by how much: the graph view colours by it,
the report lists the largest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class NodeError:
    graph_id: int
    kind: str
    node: str
    stream: str            # where the measured time ran: "compute", or the collective's stream
    predicted_us: float
    measured_us: float

    @property
    def error_us(self) -> float:
        return self.measured_us - self.predicted_us

    def to_dict(self) -> dict:
        return dict(asdict(self), error_us=round(self.error_us, 3))


def _sum_by_node(events, scale: float, source: str | None) -> dict[tuple, tuple[float, str]]:
    out: dict[tuple, list] = {}
    for e in events:
        if source is not None and e.get("source") != source:
            continue
        k = (e["graph_id"], e["kind"], e["node"])
        a, b = (e["start_us"], e["end_us"]) if "start_us" in e else (e["start_ms"], e["end_ms"])
        cur = out.setdefault(k, [0.0, e.get("stream", "compute")])
        cur[0] += (b - a) * scale
        if e.get("stream", "compute") != "compute":
            cur[1] = e["stream"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def node_errors(run, rank: int = 0) -> list[NodeError]:
    """Predicted against measured µs for every node both sides have (the record's measured step
    and the what-if of its own passes), largest absolute error first. [] where the record has
    no measured schedule or no prediction. ``run``: a run directory or a RunRecord already read
    (the report's and the inspector's: the record is not read again)."""
    from deepcompile.plan.whatif import prediction
    from deepcompile.record.reader import RunRecord, read_run

    rec = run if isinstance(run, RunRecord) else read_run(run, rank)
    measured = _sum_by_node((rec.schedule or {}).get("events", []), 1.0, "measured")
    if not measured:
        return []
    w, _ = prediction(rec.path, rec.rank)
    if w is None:
        return []
    predicted = _sum_by_node(w.schedule, 1e3, None)
    out = [NodeError(k[0], k[1], k[2], measured[k][1], round(p, 3), round(measured[k][0], 3))
           for k, (p, _) in predicted.items() if k in measured]
    out.sort(key=lambda x: -abs(x.error_us))
    return out
