"""Loading config dataclasses from untrusted mappings (parsed YAML), with errors that say what to fix.

The dataclass is the source of truth: its fields and their annotations decide which keys exist and what
types they take. An unknown key names the closest valid one; a missing required key lists them all; a
value of the wrong type is caught by `check_fields`, which every config runs on construction.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import re
import textwrap
import types
import typing
from pathlib import Path

import yaml

from megatron_dhp.errors import DhpError


class _YamlLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads `1.5e6` as a float (YAML 1.1 wants `1.5e+6`)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?[0-9][0-9_]*\.[0-9_]*$|^[-+]?\.[0-9_]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> object:
    """Parse untrusted YAML safely (no object construction), with scientific floats."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


def load_json_file(path: str | Path, *, what: str, error: type[DhpError] = DhpError) -> object:
    """Read and parse a JSON file; a missing or malformed file is an `error` naming it."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {str(p)!r} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{what} {str(p)!r} is not valid JSON ({e.msg} at line {e.lineno})") from None


def load_yaml_file(path: str | Path, *, what: str) -> object:
    """Read and parse a YAML file; a missing or malformed file is a `DhpError` naming it."""
    p = Path(path)
    if not p.is_file():
        raise DhpError(f"{what} {str(p)!r} does not exist")
    try:
        return load_yaml(p.read_text())
    except yaml.YAMLError as e:
        raise DhpError(f"{what} {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None


def from_mapping(cls: type, obj: object, *, source: str) -> object:
    """Build dataclass `cls` from `obj`: check its keys, build nested dataclasses, and let `cls` check the values.

    Types are not checked here: each config's `__post_init__` calls `check_fields`, so a bad value gets the
    same message whether it comes from YAML or from Python; this adds only where it came from (`source`).
    """
    if not isinstance(obj, dict):
        raise DhpError(f"{source}: expected a mapping of keys, got {type(obj).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    for key in obj:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(fields)}"
            raise DhpError(f"{source}: unknown key {key!r}{hint}")
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in obj]
    if missing:
        raise DhpError(f"{source}: missing key {missing[0]!r} (required: {', '.join(required)})")
    hints = _field_hints(cls)
    values = {
        key: from_mapping(hints[key], value, source=f"{source}: key {key!r}") if dataclasses.is_dataclass(hints[key]) else value
        for key, value in obj.items()
    }
    try:
        return cls(**values)
    except DhpError as e:
        raise DhpError(f"{source}: {e}") from None


def check_fields(config: object) -> None:
    """Check every field of a config dataclass against its annotation; the first bad one raises `DhpError`.

    Each config calls this first in `__post_init__` (range checks follow there), so direct construction and
    `from_mapping` share one checker and one message. Ints become floats where a float is due and lists
    become tuples, as YAML gives them.
    """
    for name, hint in _field_hints(type(config)).items():
        value = getattr(config, name)
        checked = _check(hint, value, f"key {name!r}")
        if checked is not value:
            object.__setattr__(config, name, checked)


@functools.cache
def _field_hints(cls: type) -> dict[str, object]:
    """The resolved annotation of each field a user sets (init fields not starting with `_`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def _check(hint: object, value: object, where: str) -> object:
    """`value` if it fits the annotation `hint` (converted as `check_fields` says), else a `DhpError`."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            raise DhpError(f"{where} = {value!r} must be a {hint.__name__}")
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _check(option, value, where)
            except DhpError as e:
                errors.append(str(e))
        raise DhpError(errors[0])
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise DhpError(f"{where} = {value!r} must be a list")
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return tuple(_check(item, v, where) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise DhpError(f"{where} = {value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DhpError(f"{where} = {value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DhpError(f"{where} = {value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise DhpError(f"{where} = {value!r} must be a string")
        return value
    return value


def to_mapping(obj: object) -> dict:
    """The YAML form of a config dataclass (nested dataclasses as mappings, tuples as lists)."""
    out = {}
    for f in dataclasses.fields(obj):
        if not f.init or f.name.startswith("_"):
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = to_mapping(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right under its annotation), read from the source of the class and
    of the dataclasses it inherits from (a subclass's docstring wins)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def markdown_table(cls: type, *, prefix: str = "") -> str:
    """The keys of a config dataclass as a Markdown table (key, default, meaning): docs kept with the code.
    `prefix` names the YAML section the keys sit in (e.g. `model.`)."""
    docs = field_docs(cls)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.init and not f.name.startswith("_"):
            default = "(required)" if f.default is dataclasses.MISSING else _yaml_scalar(f.default)
            rows.append(f"| `{prefix}{f.name}` | `{default}` | {docs.get(f.name, '')} |")
    return "\n".join(rows)


def _yaml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return "null" if value is None else str(value)
