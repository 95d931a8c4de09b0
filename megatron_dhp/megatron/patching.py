"""`apply-patches`: write megatron-dhp's hooks into a Megatron-LM checkout, check them, revert them, or print
them as a patch.

The hooks are the sites of `sites.py`, each found by its code, so one list serves every version; this
module only reads the checkout, asks `sites` where each call goes and writes the files, all or none. The
version (`megatron/core/package_info.py`) is reported, and whether it is one the upstream tests ran.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_dhp.errors import DhpError
from megatron_dhp.megatron import sites

CHECKED = ("0.16.1", "0.17.1", "0.18.2", "0.19.0", "0.19.1", "0.20.0")
"""megatron-core versions whose Megatron-LM (tags core_v0.16.1 to core_v0.19.0, main, dev) the upstream tests
patch and train (docs/megatron-lm.md, 'Versions')."""


@dataclass(frozen=True)
class Checkout:
    """A Megatron-LM source tree and the megatron-core version it holds."""

    path: Path
    version: str
    """MAJOR.MINOR.PATCH of megatron/core/package_info.py."""

    @property
    def name(self) -> str:
        """The checkout and its version, as every line apply-patches prints starts."""
        checked = "" if self.version in CHECKED else ", not a checked version"
        return f"Megatron-LM {self.path} (megatron-core {self.version}{checked})"


def detect(path: str | Path) -> Checkout:
    """The checkout at `path`; a clear error for a folder that is not one."""
    root = Path(path).expanduser().resolve()
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file() or not (root / "pretrain_gpt.py").is_file():
        raise DhpError(f"{str(path)!r} is not a Megatron-LM checkout (no megatron/core/package_info.py beside "
                       "pretrain_gpt.py); pass the folder that holds pretrain_gpt.py")
    text = info.read_text()
    parts = [re.search(rf"^{key}\s*=\s*(\d+)", text, flags=re.MULTILINE) for key in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise DhpError(f"{info} does not define MAJOR, MINOR and PATCH; is this a Megatron-LM checkout?")
    return Checkout(root, ".".join(p.group(1) for p in parts))


def apply(path: str | Path, *, check: bool = False, revert: bool = False) -> str:
    """Insert (or with `revert` remove) every hook; with `check` only report. Returns one line."""
    checkout = detect(path)
    old = sites.read_sources(checkout.path)
    present = sites.applied(old)
    if revert:
        if not present:
            return f"{checkout.name}: no megatron-dhp hooks, nothing to revert"
        new = {f: sites.remove(text, f) for f, text in old.items()}
        verb = "reverts cleanly" if check else "reverted"
    else:
        if present == sites.NAMES:
            return f"{checkout.name}: hooks already in place, nothing to do"
        new = hooked(checkout, old, present)
        verb = "applies cleanly" if check else "applied"
    changed = {f: text for f, text in new.items() if text != old[f]}
    if not check:
        write_all(checkout, changed, old)
    return f"{checkout.name}: {verb} ({len(sites.SITES)} hooks in {len(changed)} files: {', '.join(changed)})"


def write_all(checkout: Checkout, new: dict[str, str], old: dict[str, str]) -> None:
    """Write every file of `new` or none: each goes to a temporary file beside it first, then all are renamed
    into place; a file that cannot be written stops the run in one line with the tree as it was (`old`)."""
    staged: dict[Path, Path] = {}
    done: list[Path] = []
    try:
        for f, text in new.items():
            target = checkout.path / f
            staged[target] = target.with_name(f".{target.name}.megatron-dhp")
            staged[target].write_text(text)
        for target, temporary in staged.items():
            temporary.replace(target)
            done.append(target)
    except OSError as e:
        for target in done:  # put back what was renamed before the failure
            target.write_text(old[str(target.relative_to(checkout.path))])
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)
        raise DhpError(f"{checkout.name}: cannot write {e.filename}: {e.strerror or e}; nothing was changed (make "
                       "the checkout writable and run apply-patches again)") from None


def diff(path: str | Path) -> str:
    """The hooks as a unified diff of the checkout (for `git apply` in a fork or a container build)."""
    checkout = detect(path)
    old = sites.read_sources(checkout.path)
    new = hooked(checkout, old, sites.applied(old))
    return "".join(
        line
        for f in old
        for line in difflib.unified_diff(old[f].splitlines(keepends=True), new[f].splitlines(keepends=True),
                                         f"a/{f}", f"b/{f}")
    )


def hooked(checkout: Checkout, old: dict[str, str], present: set[str]) -> dict[str, str]:
    """Every file with its hooks inserted; a checkout with some of them already in stops instead."""
    if present == sites.NAMES:
        raise DhpError(f"{checkout.name} already has megatron-dhp's hooks; run apply-patches --revert first")
    if present:
        raise DhpError(f"{checkout.name} has only some of megatron-dhp's hooks ({', '.join(sorted(present))}); "
                       "run apply-patches --revert, then apply again")
    older = [f for f, text in old.items() if "megatron_dhp" in text]
    if older:
        raise DhpError(f"{checkout.name}: {older[0]} calls megatron_dhp without this version's markers (an older "
                       f"megatron-dhp patch?); restore it (git -C {checkout.path} checkout -- {older[0]}) and apply again")
    placements = sites.locate(old)
    return {f: sites.insert(text, [p for p in placements if p.anchor.file == f]) for f, text in old.items()}
