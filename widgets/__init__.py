"""The Jupyter layer of deepcompile, installed as the subpackage ``deepcompile.widgets`` (this
folder is mapped to that name in ``pyproject.toml``, for wheels and editable installs alike).

``Inspector(run_dir)`` browses a run record; ``Inspector.launch(...)`` starts a job and follows
it. The state of every view lives in plain-Python models (``graph_view.GraphModel``,
``timeline_view.ScheduleModel`` / ``MemoryModel``, ``steps_view.StepsModel``,
``passes_view.PassesModel``, ``launcher.Job``, and ``inspector_model.InspectorModel`` over them)
that tests drive without a browser; ``inspector.py`` is the ipywidgets face, its tabs and its
jobs in the ``inspector_*`` modules beside it.
"""
from .graph_view import GraphModel
from .launcher import Job, demo_command
from .passes_view import PassesModel
from .steps_view import StepsModel
from .timeline_view import MemoryModel, ScheduleModel


def __getattr__(name):
    # the ipywidgets face is imported lazily: the models work without ipywidgets/plotly
    if name == "InspectorModel":
        from .inspector_model import InspectorModel
        return InspectorModel
    if name == "Inspector":
        from . import inspector
        return getattr(inspector, name)
    raise AttributeError(name)


__all__ = ["Inspector", "InspectorModel", "GraphModel", "ScheduleModel", "MemoryModel", "StepsModel",
           "PassesModel", "Job", "demo_command"]
