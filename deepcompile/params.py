"""Declared parameters: one mechanism for the config tree and for every pass's parameters.

A parameter set is a dataclass whose fields carry ``spec(...)`` metadata (help, bounds,
choices). The same declaration drives validation (with the key path in every error), the CLI
(``--pass-param prefetch.budget_mb=512``), the report and the inspector's widgets.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import MISSING, dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value; the message names the key path and the fix."""


def spec(default: Any = MISSING, *, help: str, min: float | None = None, max: float | None = None,
         choices: tuple | None = None, default_factory: Any = MISSING):
    md = {"help": help, "min": min, "max": max, "choices": choices}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=md)
    return field(default=default, metadata=md)


@dataclass(frozen=True)
class ParamInfo:
    name: str
    type: str
    default: Any
    help: str
    min: float | None
    max: float | None
    choices: tuple | None


def describe(cls) -> list[ParamInfo]:
    """The declared parameters of a dataclass, for CLIs, reports and widgets."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)
        t = hints[f.name]
        out.append(ParamInfo(f.name, getattr(t, "__name__", str(t)), default,
                             f.metadata.get("help", ""), f.metadata.get("min"),
                             f.metadata.get("max"), f.metadata.get("choices")))
    return out


def _check_scalar(path: str, value: Any, t: Any, f: dataclasses.Field) -> Any:
    origin = typing.get_origin(t)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        args = typing.get_args(t)
        if value is None and type(None) in args:
            return None
        t = next(a for a in args if a is not type(None))
    if t is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
    elif t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_short(value)}")
    elif t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {_short(value)}")
        try:
            value = float(value)
        except OverflowError:   # an int beyond the float range
            raise ConfigError(f"{path}: {_short(value)} is out of range") from None
        if not math.isfinite(value):
            # every bound test is False for NaN, so budget_mb=nan would pass as "no limit"
            raise ConfigError(f"{path}: expected a finite number, got {value!r}"
                              + _bounds_hint(f))
    elif t is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}")
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if t in (int, float):
        # an undeclared bound is still int64's: a larger value reaches C++ (pybind) as a TypeError
        lo = -INT64_MAX if lo is None else lo
        hi = INT64_MAX if hi is None else hi
    if lo is not None and value < lo:
        raise ConfigError(f"{path}: {_short(value)} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{path}: {_short(value)} is above the maximum {hi}")
    return value


INT64_MAX = (1 << 63) - 1


def _short(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 100:
        return f"an integer of {v.bit_length()} bits"
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _bounds_hint(f: dataclasses.Field) -> str:
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is None and hi is None:
        return ""
    return f" (from {lo} to {hi})" if lo is not None and hi is not None else (
        f" (at least {lo})" if lo is not None else f" (at most {hi})")


def build(cls, data: Any, path: str):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and bad values."""
    if isinstance(data, cls):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        import difflib
        k = unknown[0]
        near = difflib.get_close_matches(k, fields, n=1)
        hint = f"; did you mean '{path}.{near[0]}'?" if near else ""
        raise ConfigError(f"{path}.{k}: unknown key{hint} Known keys: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:   # else cls() raises a TypeError
                raise ConfigError(f"{path}.{name}: missing; it is required ({f.metadata.get('help', '')})")
            continue
        kwargs[name] = _convert(f"{path}.{name}", data[name], hints[name], f)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check(path)
    return obj


def _convert(path: str, value: Any, t: Any, f: dataclasses.Field) -> Any:
    if dataclasses.is_dataclass(t):
        return build(t, value, path)
    origin = typing.get_origin(t)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (inner,) = typing.get_args(t)[:1]
        return [_convert(f"{path}[{i}]", v, inner, f) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if t is Any:
        return value
    return _check_scalar(path, value, t, f)
