"""Each pass declares once, at its registration, what the rest of deepcompile needs to know.

The backend (which passes only rewrite the graph), the planner (which parameters it sets, what a
missing pass stands for), the what-if (how a pass is priced offline), the plan cache and the
config (which pass lowers a ZeRO stage, requirements, conflicts) read ``PASSES[name]``; none of
them keeps a list of pass names of its own. These tests check the declarations and that no module
outside ``deepcompile/passes/`` spells a registered pass's name as a string literal.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from deepcompile.params import ConfigError
from deepcompile.passes import PASSES
from deepcompile.passes import registry as R

ROOT = Path(__file__).resolve().parents[1] / "deepcompile"


def test_every_pass_declares_every_property():
    assert len(PASSES) >= 6
    for name, p in PASSES.items():
        assert p.name == name
        assert callable(p.fn) and dataclasses.is_dataclass(p.params_cls), name
        assert isinstance(p.graph_only, bool) and isinstance(p.planner_adds, bool), name
        assert isinstance(p.plan_cacheable, bool), name
        assert p.offline in R.OFFLINE, (name, p.offline)
        fields = {f.name for f in dataclasses.fields(p.params_cls)}
        assert set(p.planned) <= fields, (name, p.planned)
        assert set(p.absent) <= set(p.planned), (name, p.absent)
        assert all(isinstance(s, int) and 1 <= s <= 3 for s in p.lowers), (name, p.lowers)
        if p.planner_adds:   # a pass the planner adds has parameters for it to set
            assert p.planned, name


def test_each_pass_module_exports_its_name():
    import importlib

    for name, p in PASSES.items():
        mod = importlib.import_module(p.fn.__module__)
        assert getattr(mod, "NAME", None) == name, f"{mod.__name__}.NAME should be {name!r}"


def test_requirements_and_conflicts_name_registered_passes():
    for name, p in PASSES.items():
        for other in (*p.requires, *p.conflicts, *p.precedes):
            assert other in PASSES, f"{name} declares {other!r}, which is not a registered pass"
            assert other != name, name


def test_every_stage_has_one_lowering_and_the_base_pass_is_one_of_them():
    for stage in (1, 2, 3):
        assert R.lowering(stage) in PASSES
    bases = [n for n, p in PASSES.items() if p.offline == R.OFFLINE_BASE]
    assert bases == [R.lowering(3)], bases   # the what-if starts from the ZeRO-3 graphs
    # a lowering inserts the communication: nothing may be required before it
    for stage in (1, 2, 3):
        assert not PASSES[R.lowering(stage)].requires


def test_the_planners_view_comes_from_the_declarations():
    from deepcompile.plan import planner as P
    from deepcompile.plan import whatif as W

    assert P.PLANNED == {n: p.planned for n, p in PASSES.items() if p.planned}
    assert set(W.GRAPH_PASSES) == {n for n, p in PASSES.items() if p.offline == R.OFFLINE_RERUN}
    # every parameter a candidate plan sets is declared planned by its pass
    cand = P.Candidate(1.0, 2.0, 3.0, 4.0, 0, 0, 0)
    for name, ps in cand.params().items():
        assert set(ps) <= set(PASSES[name].planned), (name, ps)
    # a pass the list lacks is held at values its own parameter set accepts
    for name, vals in R.absent_params([]).items():
        PASSES[name].params_cls(**vals)


def test_the_backend_reads_graph_only_from_the_declarations():
    from deepcompile.backend import Backend
    from deepcompile.passes.registry import PassEntry

    b = Backend.__new__(Backend)
    b.passes = [PassEntry(name=n) for n in PASSES]
    assert b._stateful_passes() == sorted(n for n, p in PASSES.items() if not p.graph_only)


def test_config_refuses_a_list_against_the_declarations():
    from deepcompile.config import Config

    lower3, lower12 = R.lowering(3), R.lowering(1)
    needs3 = next(n for n, p in PASSES.items() if lower3 in p.requires)
    with pytest.raises(ConfigError, match="needs"):
        Config.load({"zero_stage": 1, "passes": [lower12, needs3]})
    clash = next((n, c) for n, p in PASSES.items() for c in p.conflicts)
    with pytest.raises(ConfigError, match="cannot be in one list"):
        Config.load({"passes": [lower3, *[x for x in clash if x != lower3]]})
    # the default plan is a valid list by the same declarations
    assert not R.list_problems([e.name for e in Config.load({}).schedule[-1].passes])


def _string_literals(path: Path):
    """(line, value) of every string constant in ``path`` that is not a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_no_pass_name_literals_outside_the_passes():
    """A module outside deepcompile/passes/ refers to a pass through its declarations
    (``PASSES[name].planned``, ...) or its module's ``NAME``, never by spelling its name."""
    names = set(PASSES)
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if rel.parts[:2] == ("deepcompile", "passes"):
            continue
        for line, value in _string_literals(path):
            if value in names:
                found.append(f"  {rel}:{line}: {value!r}")
    assert not found, ("pass names spelled as string literals outside deepcompile/passes/ (use the pass "
                       "module's NAME or its PassDef's declarations):\n" + "\n".join(found))


def test_the_literal_finder_finds_a_literal(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""doc naming zero3"""\nX = {"zero3": 1}\n\ndef f():\n    """prefetch"""\n    return "prefetch"\n')
    assert [v for _, v in _string_literals(p)] == ["zero3", "prefetch"]
