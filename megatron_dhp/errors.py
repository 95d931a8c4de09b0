"""The one exception type users see, and how a user's value appears in it.

Every check on user input (files, YAML, flags, batches that cannot fit) raises `DhpError` with a message
that names the offending value and says how to fix it. The CLI prints that message as one line and exits
non-zero; library callers can catch it as a `ValueError`. A value goes into a message as `excerpt(value)`:
a 15 MB list in a config must not make a 15 MB line (nor take gigabytes to build one).
"""

from __future__ import annotations

import itertools
import reprlib


class DhpError(ValueError):
    """A user-facing error: bad input or a request that cannot be satisfied."""


class DhpStopped(DhpError):
    """The job was told to stop (SIGTERM or SIGHUP) and ended before a step boundary could save: the command
    exits as a process the signal ended does (128 + the signal), so a scheduler that requeues on it does."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class DhpRunError(DhpError):
    """A run stopped by a `DhpError` after it had started training: `partial` holds what it trained before
    (the records of the steps that ran), so that `--json` still reports them beside the error."""

    def __init__(self, message: str, partial: object) -> None:
        super().__init__(message)
        self.partial = partial


EXCERPT_CHARS = 100
"""The longest excerpt of a value a message carries."""


class _Excerpt(reprlib.Repr):
    """`reprlib.Repr` with small limits, bounded in time for every value YAML or JSON gives (huge ints too)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 2
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 4
        self.maxstring = self.maxother = self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int is quadratic in its digits and refused beyond 4300 of them
        if x.bit_length() > 128:
            return f"{'-' if x < 0 else ''}<an integer of {int(x.bit_length() * 0.30103) + 1} digits>"
        return super().repr_int(x, level)

    def repr_dict(self, x: dict, level: int) -> str:
        # in the order the user wrote the keys (reprlib sorts them)
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x) if len(x) <= self.maxstring else f"{repr(x[:self.maxstring])}..."


_EXCERPT = _Excerpt()


def excerpt(value: object) -> str:
    """A short repr of `value` for an error message: at most about `EXCERPT_CHARS` characters, computed in
    bounded time, with the size of a long string or list."""
    text = _EXCERPT.repr(value)
    if len(text) > EXCERPT_CHARS:
        text = text[:EXCERPT_CHARS - 3] + "..."
    if isinstance(value, (str, bytes)) and len(value) > _EXCERPT.maxstring:
        text += f" ({len(value):,} {'characters' if isinstance(value, str) else 'bytes'})"
    elif isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) > _EXCERPT.maxlist:
        text += f" ({len(value):,} items)"
    return text
