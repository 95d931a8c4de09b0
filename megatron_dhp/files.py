"""User files in and out: every file a user hands a command is read by `read_text` (JSON parsed by
`parse_json`), and every path a command will write is checked by `check_writable` before the command does any
work.

A file is read whole into memory, so its size is bounded per kind before a byte is read (a 99 MB plan took
7 GB to load); it must be UTF-8 text, so a binary or Latin-1 file fails here with the byte and its offset rather
than as a parser's riddle. JSON has no NaN or Infinity, which Python's json module accepts anyway, and no
bound on its numbers: `parse_json` refuses both kinds, so every number a user file yields fits an int64 or is a
finite float. Each refusal is one `DhpError` line naming the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from megatron_dhp.errors import DhpError, excerpt

MB = 1 << 20

CONFIG_BYTES = 1 * MB
"""A YAML config (train, cost, dhp): the shipped ones are under 3 KB, and the YAML parser takes about 6 s a MB."""
SPEEDS_BYTES = 4 * MB
"""A rank speeds file: one number per rank, half a million ranks."""
PLAN_BYTES = 64 * MB
"""A plan file: a plan of the largest batch (`workload.batches.MAX_BATCH_SAMPLES`) with images is about 40 MB."""
LENGTHS_BYTES = 512 * MB
"""A length file: a real corpus's lengths (tens of millions of samples, as JSONL objects)."""

INT64_MAX = 2**63 - 1
"""The largest integer a user value may hold: lengths, ranks and counts reach numpy and torch as int64."""


def read_text(path: str | Path, *, what: str, limit: int, error: type[DhpError] = DhpError) -> str:
    """The text of the user file `path` (a `what`, such as "plan file"), at most `limit` bytes, UTF-8 (a leading
    byte-order mark dropped) and free of NUL bytes; anything else is an `error` naming the file."""
    name = f"{what} {str(path)!r}"
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{name} is a folder; pass the {what} itself")
        if not stat.S_ISREG(info.st_mode):  # a pipe or a device: reading it may never end
            raise error(f"{name} is not a regular file; pass the {what} itself")
        if info.st_size > limit:
            raise error(_too_large(name, what, info.st_size, limit))
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise error(f"{name} does not exist") from None
    except OSError as e:
        raise error(f"{name} cannot be read: {e.strerror}") from None
    if len(data) > limit:  # it grew since the stat
        raise error(_too_large(name, what, len(data), limit))
    nul = data.find(b"\0")
    if nul >= 0:
        raise error(f"{name} is a binary file (a NUL byte at offset {nul}), not UTF-8 text; pass the {what} itself")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as "
                    "UTF-8") from None
    return text.removeprefix("\ufeff")


def _too_large(name: str, what: str, size: int, limit: int) -> str:
    return (f"{name} is {size / MB:,.1f} MB, over the {limit // MB} MB a {what} may hold (it is read whole into "
            "memory); pass the file you meant, or a smaller one")


class _BadNumber(ValueError):
    """A JSON number no machine type holds; `args[0]` says which and why."""


def _int(literal: str) -> int:
    value = int(literal) if len(literal) <= 20 else None  # int() of a huge literal is quadratic, then refused
    if value is None or abs(value) > INT64_MAX:
        raise _BadNumber(f"the integer {excerpt(literal)}, beyond the 64-bit range")
    return value


def _float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _BadNumber(f"the number {excerpt(literal)}, beyond a 64-bit float's range")
    return value


def _constant(literal: str) -> float:
    raise _BadNumber(f"{literal}, which JSON does not allow")


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_constant)


def parse_json(text: str, *, name: str, fix: str = "", error: type[DhpError] = DhpError) -> object:
    """`text` (read from the file that `name` names, such as "plan file 'p.json'") as JSON, or an `error`
    naming it: malformed (at which line, or column of a one-line text, followed by `fix`), nested too deep, or
    holding a NaN, an Infinity or a number beyond int64 / float64."""
    try:
        return _DECODER.decode(text)
    except _BadNumber as e:
        raise error(f"{name} holds {e.args[0]}; write finite numbers within int64") from None
    except json.JSONDecodeError as e:
        at = f"line {e.lineno}" if "\n" in text.rstrip() else f"column {e.colno}"
        raise error(f"{name} is not valid JSON ({e.msg} at {at}){'; ' + fix if fix else ''}") from None
    except RecursionError:
        raise error(f"{name} nests its lists or objects too deeply to read") from None


def check_writable(path: str | Path, *, flag: str, folder: bool = False) -> Path:
    """`path`, once sure a command can write it (with `folder`: write files into it): it is not a folder (not a
    file), no file stands where one of its folders should, and its folder exists (made here, so that the writer
    need not) and is writable. A `DhpError` naming `flag` otherwise: a run fails before its work, not after."""
    p = Path(path)
    name = f"{flag} {str(path)!r}"
    if folder and p.exists() and not p.is_dir():
        raise DhpError(f"{name} is a file, not a folder; name a folder to write into")
    if not folder and p.is_dir():
        raise DhpError(f"{name} is a folder; name a file to write")
    parent = p if folder else p.parent
    existing = next(a for a in (parent, *parent.parents) if a.exists())
    if not existing.is_dir():
        raise DhpError(f"{name} lies under {str(existing)!r}, which is a file, not a folder; name a path in a "
                       "writable folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DhpError(f"{name}: its folder {str(parent)!r} cannot be created ({e.strerror}); name a path in a "
                       "writable folder") from None
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not folder and not os.access(p, os.W_OK)):
        raise DhpError(f"{name} is not writable; name a path in a writable folder")
    return p
