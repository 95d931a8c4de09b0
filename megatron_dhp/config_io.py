"""Loading config dataclasses from untrusted mappings (parsed YAML), with errors that say what to fix.

The dataclass is the source of truth: its fields and their annotations decide which keys exist and what
types they take. An unknown key names the closest valid one; a missing required key lists them all; a
value of the wrong type is caught by `check_fields`, which every config runs on construction, and so is a
number no machine holds (an int beyond int64, a NaN or infinite float). Errors show a value as
`errors.excerpt`; files are read by `files.read_text`, and a YAML alias bomb is refused before it is built.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from pathlib import Path

import yaml

from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.files import CONFIG_BYTES, INT64_MAX, parse_json, read_text


class _YamlLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads `1.5e6` as a float (YAML 1.1 wants `1.5e+6`)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?[0-9][0-9_]*\.[0-9_]*$|^[-+]?\.[0-9_]+$"),
    list("-+0123456789."),
)


MAX_YAML_NODES = 100_000
"""The most values a YAML document may hold once its aliases are expanded (shipped configs hold under 200):
a 2 KB file of nested anchors ("billion laughs") expands to a billion, which every later walk would visit."""


def load_yaml(text: str, *, source: str = "YAML") -> object:
    """Parse untrusted YAML safely (no object construction), with scientific floats; a document whose aliases
    expand beyond `MAX_YAML_NODES` values is refused before it is built. `source` names it in errors."""
    loader = _YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, source)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node, source: str) -> None:
    """A `DhpError` if the node graph `root`, every alias expanded, holds more than `MAX_YAML_NODES` nodes or
    holds itself; each node is counted once (memoised), so a bomb is found in the time its text takes to read."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the path from the root to the node being counted
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        if counted:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_YAML_NODES:
                raise DhpError(f"{source} expands to more than {MAX_YAML_NODES:,} values through its anchors and "
                               "aliases (&name, *name); write the values out, or use fewer aliases")
        elif id(node) not in sizes:
            if id(node) in open_nodes:
                raise DhpError(f"{source} holds an alias inside the value it names (line {node.start_mark.line + 1}); "
                               "a config value cannot contain itself")
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)


def load_json_file(path: str | Path, *, what: str, limit: int, error: type[DhpError] = DhpError) -> object:
    """Read and parse a JSON file of at most `limit` bytes (`files.read_text`, `files.parse_json`); a missing,
    oversized, binary or malformed file is an `error` naming it."""
    text = read_text(path, what=what, limit=limit, error=error)
    return parse_json(text, name=f"{what} {str(path)!r}", error=error)


def load_yaml_file(path: str | Path, *, what: str) -> object:
    """Read and parse a YAML config file (`files.read_text`, `load_yaml`); a missing, oversized, binary or
    malformed file is a `DhpError` naming it."""
    name = f"{what} {str(path)!r}"
    text = read_text(path, what=what, limit=CONFIG_BYTES)
    try:
        return load_yaml(text, source=name)
    except yaml.YAMLError as e:
        raise DhpError(f"{name} is not valid YAML{_yaml_place(e)}") from None
    except RecursionError:
        raise DhpError(f"{name} nests its lists or mappings too deeply to read") from None
    except DhpError:
        raise
    except ValueError as e:  # an integer of 4300 digits or more, a date like 2024-13-01
        raise DhpError(f"{name} holds a value YAML cannot convert: {str(e).split(';')[0]}") from None


def _yaml_place(error: yaml.YAMLError) -> str:
    """Where and what a YAML syntax error is: `at line 2, column 2: expected ',' or ']', but got ':' (in the flow
    sequence from line 1, column 4)`, or the parser's first line where it gives no place."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f": {str(error).splitlines()[0]}"
    problem = getattr(error, "problem", None) or "cannot be parsed"
    context, begun = getattr(error, "context", None), getattr(error, "context_mark", None)
    where = ""
    if context and begun is not None:
        what = re.sub(r"^while \w+ ", "", context)
        where = f" ({what} from line {begun.line + 1}, column {begun.column + 1})"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}{where}"


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
            close = difflib.get_close_matches(key[:100], list(fields), n=1) if isinstance(key, str) else []
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(fields)}"
            raise DhpError(f"{source}: unknown key {excerpt(key)}{hint}")
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
    """`value` if it fits the annotation `hint` (converted as `check_fields` says), else a `DhpError` showing
    an excerpt of it. Numbers must fit a machine: ints within int64, floats finite."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            raise DhpError(f"{where} = {excerpt(value)} must be a {hint.__name__}")
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
            raise DhpError(f"{where} = {excerpt(value)} must be a list")
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return tuple(_check(item, v, where) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise DhpError(f"{where} = {excerpt(value)} must be true or false")
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float) if hint is float else int):
            raise DhpError(f"{where} = {excerpt(value)} must be {'a number' if hint is float else 'an integer'}")
        if isinstance(value, int) and abs(value) > INT64_MAX:
            raise DhpError(f"{where} = {excerpt(value)} is too large: give a number of magnitude below 2**63")
        if isinstance(value, float) and not math.isfinite(value):
            raise DhpError(f"{where} = {excerpt(value)} must be a finite number")
        return float(value) if hint is float else value
    if hint is str:
        if not isinstance(value, str):
            raise DhpError(f"{where} = {excerpt(value)} must be a string")
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
