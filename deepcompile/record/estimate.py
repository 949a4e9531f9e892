"""Moved to ``deepcompile.plan.estimate`` (issue 15: the cost model and the planner live in ``plan/``).

This alias keeps code written against the old path working: it *is* that module (same object,
private names included), not a copy. New code imports ``deepcompile.plan.estimate``.
"""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("deepcompile.plan.estimate")
