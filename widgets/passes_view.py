"""The passes view's model: the pass schedule of a run, every pass's declared parameters as
control specs (from ``deepcompile.params.describe``), the edited values, and the command line
that re-runs the job with them. :func:`make_control` turns a spec into an ipywidget.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepcompile.params import ConfigError, build, describe

from .launcher import demo_command

SLIDER_MAX_SPAN = 1e4   # wider bounded ranges get a bounded number box (a slider would be unusable)


@dataclass
class ControlSpec:
    pass_name: str
    name: str
    widget: str          # "float_slider" | "int_slider" | "dropdown" | "toggle" | "float_box" | "int_box" | "text"
    value: Any
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    step: float | None = None
    choices: tuple | None = None

    @property
    def key(self) -> str:
        return f"{self.pass_name}.{self.name}"


def control_spec(pass_name: str, p) -> ControlSpec:
    """The control for one ``ParamInfo``: dropdown for choices, toggle for bools, slider for
    bounded numbers (a bounded box when the range is too wide for a slider), text otherwise."""
    kw = dict(pass_name=pass_name, name=p.name, value=p.default, default=p.default, help=p.help,
              min=p.min, max=p.max, choices=tuple(p.choices) if p.choices else None)
    if p.choices:
        return ControlSpec(widget="dropdown", **kw)
    if p.type == "bool":
        return ControlSpec(widget="toggle", **kw)
    if p.type in ("int", "float"):
        bounded = p.min is not None and p.max is not None
        is_int = p.type == "int"
        if bounded and (p.max - p.min) <= SLIDER_MAX_SPAN:
            step = 1 if is_int else (p.max - p.min) / 200
            return ControlSpec(widget="int_slider" if is_int else "float_slider", step=step, **kw)
        return ControlSpec(widget="int_box" if is_int else "float_box", **kw)
    return ControlSpec(widget="text", **kw)


class PassesModel:
    """Pass schedule + parameter values of one run; ``command()`` for a re-run."""

    def __init__(self, config: dict | None, *, registry: dict | None = None, plan: dict | None = None):
        if registry is None:
            from deepcompile.passes import PASSES as registry
        self.registry = registry
        config = config or {}
        self.compiler = config.get("compiler")
        entries = []
        # the passes that trained last: a schedule's final entry (the default ZeRO-3 plan switches
        # to zero3+prefetch+selective_unshard at step 2), else the config's pass list
        sched = [e for e in (config.get("schedule") or []) if isinstance(e, dict) and e.get("passes")]
        listed = sched[-1]["passes"] if sched else config.get("passes")
        for e in listed or ["zero3"]:
            if isinstance(e, str):
                entries.append((e, {}))
            elif isinstance(e, dict) and "name" in e:
                entries.append((e["name"], dict(e.get("params") or {})))
        # the planner's choice (plan.json) for what the config left to it
        chosen = ((plan or {}).get("chosen") or {}).get("params") if isinstance(plan, dict) else None
        for n, p in entries:
            for k, v in ((chosen or {}).get(n) or {}).items() if isinstance(chosen, dict) else ():
                p.setdefault(k, v)
        self.recorded = [n for n, _ in entries]
        self.recorded_values = {n: dict(p) for n, p in entries}
        # the schedule: the recorded passes, then every other registered pass (disabled)
        order = [n for n in self.recorded if n in registry] + [n for n in registry if n not in self.recorded]
        self.order = order
        self.enabled = {n: n in self.recorded for n in order}
        self.specs: dict[str, list[ControlSpec]] = {}
        self.ignored: list[str] = []   # recorded values this version's declarations reject
        for n in order:
            specs = [control_spec(n, p) for p in describe(registry[n].params_cls)]
            for s in specs:
                if s.name in self.recorded_values.get(n, {}):
                    v = self.recorded_values[n][s.name]
                    try:  # a record is untrusted input: a wrong-typed value must not reach a control
                        build(registry[n].params_cls, {s.name: v}, f"passes.{n}.params")
                    except (ConfigError, TypeError, ValueError) as e:
                        self.ignored.append(f"{e} (the default {s.default!r} is shown)")
                        continue
                    s.value = v
            self.specs[n] = specs

    # ------------------------------------------------------------ edits
    def spec(self, pass_name: str, name: str) -> ControlSpec:
        for s in self.specs.get(pass_name, []):
            if s.name == name:
                return s
        raise KeyError(f"pass {pass_name!r} has no parameter {name!r}")

    def set_value(self, pass_name: str, name: str, value: Any) -> None:
        self.spec(pass_name, name).value = value

    def enable(self, pass_name: str, on: bool = True) -> None:
        if pass_name not in self.enabled:
            raise KeyError(f"unknown pass {pass_name!r}; known: {self.order}")
        self.enabled[pass_name] = bool(on)

    def reset(self) -> None:
        for n, specs in self.specs.items():
            for s in specs:
                s.value = self.recorded_values.get(n, {}).get(s.name, s.default)
            self.enabled[n] = n in self.recorded

    def describe_edits(self) -> str:
        """What differs from the recorded run, as ``selective_unshard.budget_mb=0, +offload_activations``
        (empty when the controls hold the recorded values): the label of a what-if."""
        out = []
        for n in self.order:
            on = n in self.recorded
            if self.enabled[n] != on:
                out.append(("+" if self.enabled[n] else "-") + n)
            if not self.enabled[n]:
                continue
            for s in self.specs.get(n, []):
                rec = self.recorded_values.get(n, {}).get(s.name, s.default)
                if s.value != rec:
                    v = s.value
                    out.append(f"{n}.{s.name}={v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool)
                               else f"{n}.{s.name}={v}")
        return ", ".join(out)

    @property
    def passes(self) -> list[str]:
        return [n for n in self.order if self.enabled[n]]

    def values(self, only_changed: bool = False) -> dict[str, dict]:
        out = {}
        for n in self.passes:
            d = {}
            for s in self.specs[n]:
                if only_changed and s.value == s.default:
                    continue
                v = s.value
                if s.widget in ("int_slider", "int_box") and isinstance(v, float) and v.is_integer():
                    v = int(v)
                d[s.name] = v
            if d:
                out[n] = d
        return out

    def validate(self) -> list[str]:
        """Errors (with key paths) for the current values; empty when the config is valid."""
        errs = []
        if not self.passes:
            errs.append("no pass enabled")
        for n, d in self.values().items():
            try:
                build(self.registry[n].params_cls, d, f"passes.{n}.params")
            except ConfigError as e:
                errs.append(str(e))
        return errs

    def whatif_passes(self) -> list[dict]:
        """The pass list as ``plan.whatif.predict_run`` (and the config) take it: every enabled pass
        with every shown value, so the prediction is of exactly what Run would compile."""
        try:
            from deepcompile.plan.planner import PLANNED
        except ImportError:
            PLANNED = {}
        vals, changed = self.values(), self.values(only_changed=True)
        out = []
        for n in self.passes:
            # what the planner would decide is always given (a value, never left to "auto"); any
            # other parameter only when edited: a declared default such as prefetch.backend="auto"
            # is not the planner's "auto" and is left to the pass
            p = {k: v for k, v in vals.get(n, {}).items() if k in PLANNED.get(n, ()) or k in changed.get(n, {})}
            out.append({"name": n, "params": p})
        return out

    def command(self, out: str | os.PathLike, *, ranks: int = 2, steps: int = 20, cpu: bool = False,
                batch: int | None = None, model: str | None = None, profile_step: int | None = 1) -> list[str]:
        """``python -m deepcompile demo`` re-running with the edited passes and values. The run
        profiles step ``profile_step`` (default 1, the first warm step): its record holds the
        per-operator profile and memory timeline, so what-if and Predict work on it too."""
        if profile_step is not None and steps <= profile_step:
            profile_step = None if steps < 2 else steps - 1
        return demo_command(out, passes=self.passes, pass_params=self.values(only_changed=True),
                            ranks=ranks, steps=steps, compiler=self.compiler, cpu=cpu, batch=batch,
                            model=model, profile_step=profile_step)

    def whatif(self, run_dir: str | os.PathLike, *, rank: int = 0, memory_limit_gib: float | None = None):
        """Predicted step time and memory of the edited values on ``run_dir``'s traced graphs
        (:func:`deepcompile.plan.whatif.predict_run`: the passes and planner re-run offline, no
        re-compile). Raises ConfigError (a bad value, named) or WhatIfError (the record cannot
        answer: no profile, no zero3 graphs), each with the reason."""
        from deepcompile.plan.whatif import predict_run

        return predict_run(run_dir, self.whatif_passes(), rank=rank, memory_limit_gib=memory_limit_gib)


    def predict(self, record) -> str:
        """One line: the what-if of the edited values on ``record`` (see :meth:`whatif`), beside
        the run's one measured peak (``record.reader.memory_view``); without a recorded profile it
        says so and never invents numbers."""
        if record is None or not getattr(record, "profile", None):
            return ("no profile in this record: a prediction needs the measured per-operator profile "
                    "of a previous iteration (run with a profile step, e.g. demo --profile-step 1)")
        from deepcompile.profile.profiler import Profile

        hw = Profile.from_records(record.profile).hardware or "unknown hardware"   # validates it, comm included
        try:
            w = self.whatif(record.path, rank=getattr(record, "rank", 0))
        except Exception as e:  # ConfigError / WhatIfError: the value or the reason, named
            return f"no prediction from the recorded profile ({hw}): {e}"
        try:
            from deepcompile.record.reader import format_peak, memory_view

            measured = "; this run's " + format_peak(memory_view(record, getattr(record, "rank", 0)))
        except Exception:
            measured = ""
        warn = "".join(f"; WARNING: {x}" for x in (getattr(w, "warnings", None) or []))
        return (f"{w.headline()}: predicted from the recorded profile ({hw}) by a what-if of these values "
                f"({w.seconds:.2f} s, no re-compile){warn}{measured}")


def new_run_dir(base: str | os.PathLike, stem: str = "rerun") -> Path:
    """A fresh run directory beside ``base`` (``<base>-rerun1``, ``-rerun2``, ...)."""
    base = Path(base)
    i = 1
    while True:
        p = base.with_name(f"{base.name}-{stem}{i}")
        if not p.exists():
            return p
        i += 1


# --------------------------------------------------------------------------- ipywidgets
def make_control(spec: ControlSpec, on_change=None):
    """An ipywidget for ``spec``; help text as tooltip; edits write back into ``spec.value``."""
    import ipywidgets as W

    common = dict(description=spec.name, tooltip=spec.help, style={"description_width": "110px"},
                  layout=W.Layout(width="420px"))
    w = spec.widget
    if w == "dropdown":
        c = W.Dropdown(options=list(spec.choices), value=spec.value, **common)
    elif w == "toggle":
        c = W.ToggleButton(value=bool(spec.value), description=spec.name, tooltip=spec.help)
    elif w == "int_slider":
        c = W.IntSlider(value=int(spec.value), min=int(spec.min), max=int(spec.max), step=1,
                        continuous_update=False, **common)
    elif w == "float_slider":
        c = W.FloatSlider(value=float(spec.value), min=spec.min, max=spec.max, step=spec.step,
                          continuous_update=False, **common)
    elif w == "int_box":
        lo = int(spec.min) if spec.min is not None else -(2 ** 31)
        hi = int(spec.max) if spec.max is not None else 2 ** 31
        c = W.BoundedIntText(value=int(spec.value), min=lo, max=hi, **common)
    elif w == "float_box":
        lo = spec.min if spec.min is not None else -1e30
        hi = spec.max if spec.max is not None else 1e30
        c = W.BoundedFloatText(value=float(spec.value), min=lo, max=hi, **common)
    else:
        c = W.Text(value=str(spec.value), **common)
    c.add_class("dc-param")
    c.add_class(f"dc-param-{spec.pass_name}-{spec.name}")

    def _changed(ch):
        spec.value = ch["new"]
        if on_change is not None:
            on_change(spec)

    c.observe(_changed, names="value")
    bounds = ""
    if spec.min is not None or spec.max is not None:
        bounds = f" [{spec.min if spec.min is not None else '−∞'} … {spec.max if spec.max is not None else '∞'}]"
    helptext = W.HTML(f"<span style='font-size:11px;color:#666'>{_esc(spec.help)}{_esc(bounds)}; "
                      f"default {_esc(repr(spec.default))}</span>")
    return c, W.HBox([c, helptext])


def _esc(s: str) -> str:
    import html

    return html.escape(str(s))
