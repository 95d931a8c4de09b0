"""The folders megatron-dhp ships (`configs/`) and the YAML presets found in `configs/` by name.

A source checkout has them beside the package; `pip install` puts them under `share/megatron-dhp/`. Every
place that reads a shipped file (cost presets, train configs) looks them up here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_dhp.errors import DhpError


def shipped_dirs(name: str) -> list[Path]:
    """Where a shipped folder lives: the source checkout's, then the installed share folder."""
    return [Path(__file__).resolve().parents[1] / name, Path(sys.prefix) / "share" / "megatron-dhp" / name]


def shipped_file(folder: str, filename: str) -> Path | None:
    """`folder/filename` from the first shipped folder that has it (None: no install has it)."""
    for d in shipped_dirs(folder):
        if (d / filename).is_file():
            return d / filename
    return None


def resolve_preset(path_or_name: str | Path, *, what: str, noun: str = "preset") -> Path:
    """A YAML path as given, or `configs/<name>.yaml` for a name; else an error listing the shipped names.

    `what` names the file in the error (`cost config`), `noun` what a shipped one is called (`preset`).
    """
    path = Path(path_or_name)
    if path.is_file():
        return path
    if path.suffix not in (".yaml", ".yml"):
        found = shipped_file("configs", f"{path_or_name}.yaml")
        if found is not None:
            return found
    names = sorted({p.stem for d in shipped_dirs("configs") if d.is_dir() for p in d.glob("*.yaml")})
    raise DhpError(f"{what} {str(path_or_name)!r} is neither a file nor a {noun} in configs/; "
                   f"{noun}s: {', '.join(names) or 'none'}")
