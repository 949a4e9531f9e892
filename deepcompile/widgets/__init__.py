"""``deepcompile.widgets``: the top-level ``widgets/`` directory of the source tree, under this name.

The Jupyter layer lives in ``widgets/`` (an optional extra; the core never imports it). This shim
makes that directory this package's search path and runs its ``__init__``, so
``import deepcompile.widgets`` and ``from deepcompile.widgets.graph_view import GraphModel`` work
from a source checkout and from ``pip install -e .`` without copying files.
"""
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
_candidates = [_here.parents[1] / "widgets", _here / "_widgets"]
_dir = next((p for p in _candidates if (p / "__init__.py").is_file()), None)
if _dir is None:
    raise ImportError("deepcompile.widgets: the widgets/ directory was not found beside the deepcompile "
                      f"package (looked in {', '.join(map(str, _candidates))}); install from a source "
                      "checkout with pip install -e '.[notebook]'")
__path__ = [str(_dir)]
_init = _dir / "__init__.py"
exec(compile(_init.read_text(encoding="utf-8"), str(_init), "exec"))
del _Path, _here, _candidates, _init
