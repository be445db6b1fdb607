"""Environment parameters and engine settings of the ML-Agents backend: checked in the trainer's
process before anything is sent (:func:`normalize_env_parameters`, :func:`normalize_engine_config`),
applied to the side channels in the worker (:func:`apply_env_parameter`)."""

from __future__ import annotations

import numbers
import struct
from collections.abc import Mapping
from typing import Any

from envmanager.errors import InvalidInputError

__all__ = ["normalize_env_parameters", "normalize_engine_config", "apply_env_parameter", "ENGINE_FIELDS"]

ENGINE_FIELDS = {
    "width": int,
    "height": int,
    "quality_level": int,
    "time_scale": float,
    "target_frame_rate": int,
    "capture_frame_rate": int,
}
SAMPLERS = {
    "uniform": ("min_value", "max_value"),
    "gaussian": ("mean", "st_dev"),
    "multirangeuniform": ("intervals",),
    "constant": ("value",),
}


def normalize_env_parameters(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check environment parameters; return them as floats, sampler dicts or ML-Agents settings.

    A value is a number (``set_float_parameter``), an object with ``apply(key, channel)`` (ML-Agents'
    ``ParameterRandomizationSettings``), or a sampler dict in ML-Agents' YAML shape:
    ``{"sampler_type": "uniform", "sampler_parameters": {"min_value": 1, "max_value": 2, "seed": 0}}``
    (``gaussian``: ``mean``, ``st_dev``; ``multirangeuniform``: ``intervals``; ``constant``:
    ``value``; the parameters may also sit next to ``sampler_type``).
    """
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise InvalidInputError(f"environment parameters must be a mapping, got {type(config).__name__}")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not key:
            raise InvalidInputError(f"environment parameter names must be non-empty strings, got {key!r}")
        out[key] = _normalize_value(key, value)
    return out


def _wire(kind: str, what: str, value: Any) -> Any:
    """``value`` if the side channels can encode it (``kind``: struct's ``"f"`` float32 or ``"i"``
    int32, as ``OutgoingMessage`` writes it), else ``InvalidInputError`` (before anything is sent)."""
    try:
        struct.pack("<" + kind, value)
    except (struct.error, OverflowError) as exc:
        raise InvalidInputError(f"{what}: {value!r} does not fit the side channel's "
                                f"{'float32' if kind == 'f' else 'int32'} ({exc})") from None
    return value


def _normalize_value(key: str, value: Any) -> Any:
    if isinstance(value, numbers.Real):
        return _wire("f", f"environment parameter {key!r}", float(value))
    if callable(getattr(value, "apply", None)):
        return value
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            f"environment parameter {key!r}: expected a number, a sampler dict or a settings object "
            f"with apply(key, channel), got {value!r}"
        )
    kind = str(value.get("sampler_type", "")).lower().replace("_", "").replace("-", "")
    if kind not in SAMPLERS:
        raise InvalidInputError(f"environment parameter {key!r}: unknown sampler_type {value.get('sampler_type')!r}; "
                                f"known: {sorted(SAMPLERS)}")
    params = dict(value.get("sampler_parameters") or {})
    params.update({k: v for k, v in value.items() if k not in ("sampler_type", "sampler_parameters")})
    missing = [name for name in SAMPLERS[kind] if name not in params]
    if missing:
        raise InvalidInputError(f"environment parameter {key!r}: the {kind} sampler needs {missing}")
    try:
        what = f"environment parameter {key!r}"
        if kind == "constant":
            return _wire("f", what, float(params["value"]))
        seed = _wire("i", f"{what} seed", int(params.get("seed", 0)))
        if kind == "multirangeuniform":
            intervals = [(_wire("f", what, float(lo)), _wire("f", what, float(hi))) for lo, hi in params["intervals"]]
            return {"sampler_type": kind, "intervals": intervals, "seed": seed}
        a, b = SAMPLERS[kind]
        return {"sampler_type": kind, a: _wire("f", what, float(params[a])), b: _wire("f", what, float(params[b])),
                "seed": seed}
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"environment parameter {key!r}: bad sampler parameters ({exc})") from None


def apply_env_parameter(channel: Any, key: str, value: Any) -> None:
    """Queue one normalized parameter on an ``EnvironmentParametersChannel``."""
    if isinstance(value, float):
        channel.set_float_parameter(key, value)
    elif isinstance(value, dict):
        kind, seed = value["sampler_type"], value["seed"]
        if kind == "uniform":
            channel.set_uniform_sampler_parameters(key, value["min_value"], value["max_value"], seed)
        elif kind == "gaussian":
            channel.set_gaussian_sampler_parameters(key, value["mean"], value["st_dev"], seed)
        else:
            channel.set_multirangeuniform_sampler_parameters(key, value["intervals"], seed)
    else:
        value.apply(key, channel)


def normalize_engine_config(config: Any = None, **fields: Any) -> dict[str, Any]:
    """Check an engine configuration (an ``EngineConfig``, a dict and/or keyword fields): the
    fields that are set, with their types fixed; ``width`` and ``height`` go together."""
    values: dict[str, Any] = {}
    if config is not None:
        if hasattr(config, "_asdict"):
            values.update(config._asdict())
        elif isinstance(config, Mapping):
            values.update(config)
        else:
            raise InvalidInputError(f"engine config must be an EngineConfig or a dict, got {config!r}")
    values.update(fields)
    unknown = sorted(set(values) - set(ENGINE_FIELDS))
    if unknown:
        raise InvalidInputError(f"unknown engine config fields {unknown}; known: {list(ENGINE_FIELDS)}")
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        try:
            out[name] = ENGINE_FIELDS[name](value)
        except (TypeError, ValueError, OverflowError):
            raise InvalidInputError(f"engine config {name}={value!r} is not a {ENGINE_FIELDS[name].__name__}") from None
    for name, value in out.items():
        _wire("f" if ENGINE_FIELDS[name] is float else "i", f"engine config {name}", value)
    if ("width" in out) != ("height" in out):
        raise InvalidInputError("engine config: width and height must be set together")
    return out
