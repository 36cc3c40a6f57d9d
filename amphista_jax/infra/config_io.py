"""YAML -> frozen, typed dataclasses, with `a.b=value` overrides from the command line.

A field whose annotation is a class with a `config_types()` classmethod (name -> subclass: a registry, as levanter's
registered config subclasses) is written as a mapping with a `type`, the registered name, beside the fields of that
subclass: `drafter: {type: medusa, num_heads: 4}` builds `config_types()["medusa"](num_heads=4)`. `to_dict` writes
a config back in that form.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from amphista_jax.infra.errors import UserError

T = TypeVar("T")


class ConfigFileError(UserError, ValueError):
    """A config file or override that does not fit its dataclass."""


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a nested mapping; unknown keys are an error naming the valid ones."""
    label = where.rstrip(": .") or cls.__name__  # "file.yaml: optim." -> "file.yaml: optim"
    if not isinstance(data, Mapping):
        raise ConfigFileError(f"{label}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - fields
    if unknown:
        raise ConfigFileError(f"{label}: unknown key(s) {sorted(unknown)}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, f"{where}{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigFileError(f"{label}: {e}") from e


def _registry(hint: Any) -> Mapping[str, type] | None:
    """The registered subclasses of a field's class by name, where it keeps a registry (`config_types`)."""
    types_of = getattr(hint, "config_types", None) if isinstance(hint, type) else None
    return types_of() if callable(types_of) else None


def _from_registry(hint: type, registry: Mapping[str, type], value: Any, where: str) -> Any:
    """`{type: name, **fields}` -> `registry[name]` built from `fields` (a value already built passes as it is)."""
    if isinstance(value, hint):
        return value
    names = ", ".join(registry)
    if not isinstance(value, Mapping):
        raise ConfigFileError(f"{where}: expected a mapping of a type ({names}) and its settings, e.g. "
                              f"{{type: {next(iter(registry))}}}, got {value!r}")
    name = value.get("type")
    if name is None:
        raise ConfigFileError(f"{where}: no type: add {where.rpartition(': ')[2]}.type, one of {names}")
    if not isinstance(name, str) or name not in registry:
        raise ConfigFileError(f"{where}.type {name!r} is not one of {names}")
    return from_dict(registry[name], {k: v for k, v in value.items() if k != "type"}, where + ".")


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if (registry := _registry(hint)) is not None:
        return _from_registry(hint, registry, value, where)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(args[0], value, where)
    if origin is tuple and isinstance(value, Sequence) and not isinstance(value, str):
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_convert(item, v, where) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigFileError(f"{where}: expected a mapping (key: value, ...), got {value!r}")
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        return {_convert(key_hint, k, f"{where}.{k}"): _convert(value_hint, v, f"{where}.{k}")
                for k, v in value.items()}
    if hint in (int, float) and isinstance(value, bool):  # bool is an int subclass: `steps=true` is a typo
        raise ConfigFileError(f"{where}: expected {hint.__name__}, got {value!r}")
    if hint is float and isinstance(value, int | str):
        try:  # YAML 1.1 reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigFileError(f"{where}: expected float, got {value!r}") from None
    if hint is str and value is None:
        raise ConfigFileError(f"{where}: expected str, got nothing (write {where.rpartition(': ')[2]}='' for an "
                              "empty string)")
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ConfigFileError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def to_dict(value: Any) -> Any:
    """A config as the plain data `from_dict` reads back (tuples stay tuples): each dataclass a mapping of its
    fields, with the `type` it is registered under (`config_types`) first where its class keeps a registry."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
        registry = _registry(type(value)) or {}
        name = next((n for n, cls in registry.items() if cls is type(value)), None)
        return fields if name is None else {"type": name} | fields
    if isinstance(value, tuple | list):
        return type(value)(to_dict(v) for v in value)
    if isinstance(value, Mapping):
        return {k: to_dict(v) for k, v in value.items()}
    return value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.sub=value` strings (values parsed as YAML) to a nested dict, returning a new dict."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigFileError(f"override {item!r} must look like key=value (e.g. train.steps=100)")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p) or {}, Mapping):
                raise ConfigFileError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node[p] = dict(node.get(p) or {})
            node = node[p]
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigFileError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]}); "
                                  "quote it, e.g. key='...'") from None
    return data


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`: mappings merge key by key, anything else in `top` replaces."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _merge(out[key], value) if both else value
    return out


def read_yaml(path: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config as a dict, with its `base:` files (a path or a list, relative to this file) merged under it
    in order."""
    path = Path(path)
    if not path.is_file():
        where = f" (a base of {seen[-1]})" if seen else ""
        problem = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
        raise ConfigFileError(f"config file {str(path)!r} {problem}{where}")
    if path.resolve() in seen:
        raise ConfigFileError(f"{path}: its bases include itself ({' -> '.join(map(str, seen + (path,)))})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(data, Mapping):
        raise ConfigFileError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    bases = data.pop("base", None) or []
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigFileError(f"{path}: base must be a file name or a list of them (relative to {path.parent}), got "
                              f"{bases!r}")
    merged: dict[str, Any] = {}
    for base in bases:
        merged = _merge(merged, read_yaml(path.parent / base, seen + (path.resolve(),)))
    return _merge(merged, data)


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Load `path` (YAML, with its `base:` files; None = all defaults) into `cls`, then apply `overrides`."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides), where="" if path is None else f"{path}: ")
