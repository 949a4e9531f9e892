"""What ``deepcompile inspect`` prints about a run record: the run, its graphs pass by pass, its
steps, memory, the prediction of its passes and what each pass bought, the plan and the command
that made it."""
from __future__ import annotations

import os
from pathlib import Path


def summarize(run_dir: str | os.PathLike, rank: int = 0, passes: list | None = None) -> str:
    """What ``deepcompile inspect`` prints; ``passes``: the pass list whose prediction it states
    (default: the run's own)."""
    from deepcompile.vocab.memory import fmt_bytes
    from deepcompile.record.reader import read_run
    from deepcompile.report.graph_groups import diff

    rec = read_run(run_dir, rank)
    m, env = rec.manifest, rec.environment
    lines = [f"run {rec.path}: {m['status']}, {m['world_size']} rank(s), format v{m['format_version']}, "
             f"torch {env['torch']}, python {env['python']}, host {env['hostname']}"
             + (f", devices {', '.join(env['devices'])}" if env["devices"] else ", CPU"),
             f"config: compiler {rec.config.get('compiler')}, zero stage {rec.config.get('zero_stage')}, "
             f"passes {[p.get('name') if isinstance(p, dict) else p for p in rec.config.get('passes', [])]}",
             f"graphs ({len(rec.graph_ids)}):"]
    for gid in rec.graph_ids:
        for kind in rec.kinds(gid):
            # one chain per compile: a scheduled re-compile starts again from "input"
            chains: list[list] = []
            for v in rec.versions(gid, kind):
                if v.after == "input" or not chains:
                    chains.append([])
                chains[-1].append(v)
            for c, vs in enumerate(chains):
                parts = [f"input {len(vs[0].nodes)}"]
                for prev, v in zip(vs, vs[1:]):
                    d = diff(prev.nodes, v.nodes)
                    comm = ", ".join(f"{k} {n}" for k, n in sorted(d["comm_added"].items()))
                    parts.append(f"{v.after} {len(v.nodes)} (+{d['added']}/-{d['removed']}"
                                 + (f"; comm added: {comm}" if comm else "") + ")")
                tag = f" [compile {c + 1}/{len(chains)}]" if len(chains) > 1 else ""
                lines.append(f"  graph {gid} {kind:<9}{tag} " + " -> ".join(parts))
    st = rec.steps
    if st:
        from deepcompile.record.steps import special_steps, steady_median_ms
        from deepcompile.report.style import fmt_ms

        times = [s["time_s"] for s in st]
        losses = [s["loss"] for s in st if s.get("loss") is not None]
        # the median of the steady steps, as the report and the inspector state it; the compile,
        # profiling and re-compile steps named by their record step numbers
        med, n = steady_median_ms(st, rec.config)
        special = special_steps(st, rec.config)
        lines.append(f"steps: {len(st)}" + (" (+1 partial line skipped)" if rec.skipped_lines else "")
                     + f"; step time first {fmt_ms(times[0] * 1e3)}, "
                     + (f"median {fmt_ms(med)} of {n} steady step(s)" if med is not None else "no steady step")
                     + f", last {fmt_ms(times[-1] * 1e3)}")
        if special:
            lines.append("  not steady: " + ", ".join(f"step {k}: {v}" for k, v in sorted(special.items())))
        if losses:
            lines.append(f"loss: first {losses[0]:.4f}, min {min(losses):.4f}, last {losses[-1]:.4f}")
    else:
        lines.append("steps: none recorded")
    from deepcompile.record.reader import format_peak, memory_view

    # the one peak of the run (measured timeline, else the plan's prediction) with its categories;
    # then the other side when both exist, and the per-step process memory, each labelled
    view = memory_view(rec)
    lines.append(format_peak(view) + (f" ({view['peak']['bytes']} bytes)" if view["peak"] else ""))
    if view["measured"] and view["predicted"]:
        pp = view["predicted"]["peak"]
        lines.append(f"  {view['predicted']['label']}: {fmt_bytes(pp['bytes'])} ("
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in pp["by_category"].items() if v) + ")")
    if view.get("trained"):
        t = view["trained"]
        err = (view["predicted"] or {}).get("error_vs_trained")
        lines.append(f"  {t['label']}: {fmt_bytes(t['bytes'])}"
                     + (f" (the plan's prediction {100 * err:+.1f}%)" if err is not None else ""))
    proc = view["process"]
    lines.append(f"{proc['label']}: "
                 + ", ".join(f"rank {r} {fmt_bytes(b)}" for r, b in sorted(proc["by_rank"].items())))
    extra = [n for n, x in (("profile", rec.profile), ("schedule", rec.schedule), ("memory timeline", rec.memory)) if x]
    lines.append("also recorded: " + (", ".join(extra) if extra else "nothing else"))
    if rec.profile:   # the one prediction engine's numbers (the report and the inspector show the same)
        from deepcompile.plan.whatif import prediction

        w, line = prediction(run_dir, rank, passes)
        lines.append(line)
        if w is not None:
            from deepcompile.plan.bought import pass_table, table_lines

            lines.append("what each pass bought (predicted; each row adds one pass):")
            lines += table_lines(pass_table(run_dir, passes, rank=rank))
    from deepcompile.record.reader import run_command

    cmd = run_command(rec)
    if cmd is not None:
        lines.append("command: " + (" ".join(cmd["relaunch"]) + f"  (in {cmd['cwd']})" if cmd.get("relaunch")
                                    else f"cannot be run again: {cmd.get('why_not', 'unknown launcher')}"))
    from deepcompile.record.reader import load_json
    from deepcompile.record.schema import PLAN, rank_dir_name

    plan = load_json(Path(run_dir) / rank_dir_name(rank) / PLAN, optional=True, root=run_dir)
    if isinstance(plan, dict) and isinstance(plan.get("chosen"), dict):  # the planner's choice, and why
        lines.append(str(plan.get("summary") or plan["chosen"].get("params")))
        if plan.get("why"):
            lines.append(f"  why: {plan['why']}")
    return "\n".join(lines)
