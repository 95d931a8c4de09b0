"""Run a Megatron-LM script with megatron-dhp's hooks, without patching the checkout.

    torchrun --nproc-per-node 8 -m megatron_dhp.megatron.run pretrain_gpt.py <Megatron-LM flags> --dhp ...

The hooks are the sites of `sites.py`, the same list `apply-patches` writes: here an import hook inserts them
into each site file's source as Python imports it (and into the script itself), so line numbers in
tracebacks shift by the few lines inserted, and the files on disk stay as they are. Where a site cannot
be found the run stops before training with the line `apply-patches --check` would print.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

from megatron_dhp.errors import DhpError
from megatron_dhp.megatron import sites


class HookedLoader(importlib.machinery.SourceFileLoader):
    """Compiles a site file with its hooks inserted; never writes bytecode (the file on disk is unhooked)."""

    def __init__(self, fullname: str, path: str, placements: list[sites.Placement]):
        super().__init__(fullname, path)
        self.placements = placements

    def get_code(self, fullname: str):
        """The module's code: its source with the hooks inserted, compiled under its own file name."""
        return _hooked_code(self.path, self.placements)


class HookFinder(importlib.abc.MetaPathFinder):
    """Hands each site module of one checkout to a `HookedLoader`."""

    def __init__(self, root: Path, placements: list[sites.Placement]):
        self.modules = {}
        for p in placements:
            module = p.anchor.file.removesuffix(".py").replace("/", ".")
            self.modules.setdefault(module, (root / p.anchor.file, []))[1].append(p)

    def find_spec(self, fullname, path, target=None):
        """The usual spec with a hooking loader, for a site module found in the checkout; None otherwise."""
        if fullname not in self.modules:
            return None
        file, placements = self.modules[fullname]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or Path(spec.origin).resolve() != file.resolve():
            raise DhpError(f"{fullname} imports from {spec.origin if spec else 'nowhere'}, not from the checkout of "
                           f"the script ({file}); put the checkout first on PYTHONPATH")
        spec.loader = HookedLoader(fullname, spec.origin, placements)
        return spec


def install(script: str | Path) -> list[sites.Placement]:
    """Hook the Megatron-LM checkout that holds `script`: its site modules get their hooks as they are imported
    (call before anything imports megatron.training). Returns the script's own placements."""
    root = Path(script).resolve().parent
    placements = sites.locate(sites.read_sources(root))
    name = Path(script).name
    sys.meta_path.insert(0, HookFinder(root, [p for p in placements if p.anchor.file != name]))
    return [p for p in placements if p.anchor.file == name]


def run_script(script: str | Path, placements: list[sites.Placement]) -> None:
    """Execute `script` as `__main__` with its placements inserted."""
    path = str(Path(script).resolve())
    code = _hooked_code(path, placements)
    main = type(sys)("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _hooked_code(path: str, placements: list[sites.Placement]):
    """The file's source with its placements inserted, compiled under its own name (tracebacks point at it)."""
    return compile(sites.insert(Path(path).read_text(), placements), path, "exec", dont_inherit=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_dhp.megatron.run SCRIPT [flags]`: the script's folder first on sys.path, as python
    would put it, the hooks installed, the script run with the flags."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dhp.megatron.run",
        description="Run a Megatron-LM script (pretrain_gpt.py) with megatron-dhp's hooks made in memory: the same "
        "sites `megatron-dhp apply-patches` writes, found by their code; the checkout stays unpatched.",
    )
    parser.add_argument("script", help="the script inside a Megatron-LM checkout, e.g. pretrain_gpt.py")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="its flags, --dhp and the --dhp-* ones included")
    args = parser.parse_args(argv)
    if not Path(args.script).is_file():
        parser.exit(2, f"megatron-dhp: error: script {args.script!r} is not a file; pass the script inside a "
                    "Megatron-LM checkout, e.g. path/to/Megatron-LM/pretrain_gpt.py\n")
    try:
        placements = install(args.script)
    except DhpError as error:
        parser.exit(2, f"megatron-dhp: error: {error}\n")
    sys.argv = [args.script, *args.flags]
    sys.path.insert(0, str(Path(args.script).resolve().parent))
    run_script(args.script, placements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
