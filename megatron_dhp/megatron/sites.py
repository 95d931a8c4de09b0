"""Where megatron-dhp's hooks go in a Megatron-LM checkout, found by what the code is.

Each `Site` is one call into `megatron_dhp.megatron`, placed before or after a statement found by its code
(`Anchor`: the function it sits in and the statement's text), never by the lines around it, so the same list
serves every Megatron-LM from core_v0.16.1 to main and dev. A site may name alternative anchors, in order,
for code that moved between versions (the layer spec: 0.19+'s `pretrain_gpt.py` model config, else
`gpt_builders.py`). `apply-patches` writes the edits into a checkout (`patching.py`); the launcher
(`run.py`) makes them in memory as Megatron-LM's modules are imported. Both ask `locate` and `edit`.

Every inserted block starts with a `# megatron-dhp: SITE` marker line, which is how an applied site is
recognised and reverted; a checkout where an anchor cannot be found stops with one line naming the site.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from megatron_dhp.errors import DhpError

MARKER = "# megatron-dhp: "
"""Starts the first line of every inserted block, followed by the site's name."""
_MARKER_LINE = re.compile(rf"^(\s*){re.escape(MARKER)}(\w+)", flags=re.MULTILINE)
"""A marker line: its indentation and its site's name."""

MAIN = "__main__"
"""The scope name for a script's `if __name__ == "__main__":` block."""


@dataclass(frozen=True)
class Anchor:
    """A statement found by its code: the first simple statement in `scope` whose text matches `code`."""

    file: str
    """Path inside the Megatron-LM checkout."""
    scope: str
    """The function it sits in (top-level `def`), or `MAIN`."""
    code: str
    """Regular expression searched in the statement's source (the first statement for `""`)."""
    where: Literal["before", "after"]
    """Insert the block before or after the statement."""
    lift: bool = False
    """Insert around the scope's top-level statement that holds the match (an `if`/`else` as a whole)."""
    block: str | None = None
    """The code for this anchor where it differs from the site's (other variable names there)."""

    def describe(self) -> str:
        """How a person would find it: `train() in megatron/training/training.py: forward_backward_func = ...`."""
        scope = 'the if __name__ == "__main__" block' if self.scope == MAIN else f"{self.scope}()"
        code = re.sub(r"\\(.)", r"\1", self.code.strip("^$"))
        return f"{scope} in {self.file}: {code or 'its first statement'}"


@dataclass(frozen=True)
class Site:
    """One call into megatron_dhp.megatron, with the anchors it may sit at (first found wins)."""

    name: str
    """Its name in the marker line, the refusals and the docs."""
    why: str
    """What the call does, for the docs and the marker line."""
    block: str
    """The code inserted (after the marker line), indented as the anchor statement is."""
    anchors: tuple[Anchor, ...]


SITES: tuple[Site, ...] = (
    Site("flags", "the --dhp flags beside any extra_args_provider",
         "from megatron_dhp.megatron import with_dhp_args\n"
         "extra_args_provider = with_dhp_args(extra_args_provider)",
         (Anchor("megatron/training/arguments.py", "parse_args", "", "before"),)),
    Site("validate", "refuse what cannot work before anything is built",
         "from megatron_dhp.megatron import refuse_or_config\n"
         "refuse_or_config(args)",
         (Anchor("megatron/training/arguments.py", "validate_args", r"^return args$", "before"),)),
    Site("layer_spec", "attention and RoPE on each microbatch's group",
         "if getattr(args, 'dhp', False):\n"
         "    from megatron_dhp.megatron import layer_spec_provider\n"
         "    model_cfg.transformer_layer_spec = layer_spec_provider(model_cfg.transformer_layer_spec, args)",
         (Anchor("pretrain_gpt.py", MAIN, r"^model_cfg = gpt_config_from_args\(", "after", lift=True),
          Anchor("gpt_builders.py", "gpt_builder", r"^model = GPTModel\(", "before",
                 block="if getattr(args, 'dhp', False):\n"
                       "    from megatron_dhp.megatron import layer_spec\n"
                       "    transformer_layer_spec = layer_spec(transformer_layer_spec, args)"))),
    Site("setup", "groups and planner; the data iterators yield planned steps",
         "if getattr(args, 'dhp', False):\n"
         "    from megatron_dhp.megatron import setup as dhp_setup\n"
         "    train_data_iterator, valid_data_iterator, test_data_iterator = dhp_setup(\n"
         "        args, train_data_iterator, valid_data_iterator, test_data_iterator\n"
         "    )",
         (Anchor("megatron/training/training.py", "pretrain",
                 r"^timers\('train/valid/test-data-iterators-setup'\)\.stop\(\)", "before"),)),
    *(Site(f"schedule_{scope}", "this rank's microbatches of each step's plan",
           "if getattr(args, 'dhp', False):\n"
           "    from megatron_dhp.megatron import dhp_forward_backward as forward_backward_func",
           (Anchor("megatron/training/training.py", scope, r"^forward_backward_func = get_forward_backward_func\(",
                   "after"),))
      for scope in ("train", "evaluate")),
    Site("forward_step", "the next microbatch of the step's plan, on its dynamic CP group",
         "if getattr(args, 'dhp', False):\n"
         "    from megatron_dhp.megatron import forward_step as dhp_forward_step\n"
         "    return dhp_forward_step(data_iterator, model, loss_func)",
         (Anchor("pretrain_gpt.py", "forward_step", r"^args = get_args\(\)$", "after"),)),
)
"""Every hook, in the order a run meets them."""

SITE_FILES = tuple(dict.fromkeys(a.file for s in SITES for a in s.anchors))
"""Every file a site may edit."""
NAMES = frozenset(s.name for s in SITES)
"""Every site's name: a checkout that has them all is hooked."""


class Placement(NamedTuple):
    """A site at the first of its anchors the file has: insert `lines` (the marker line and the block, indented
    as the anchor statement) before line `line` (1-based) of the anchor's file."""

    site: Site
    anchor: Anchor
    line: int
    lines: tuple[str, ...]


def locate(sources: dict[str, str]) -> list[Placement]:
    """Where each site goes in these files (path -> source text; absent files are skipped): for each site its
    first anchor that is found. A site with no anchor found stops with one line naming it."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    lines = {path: text.splitlines() for path, text in sources.items()}
    placements = []
    for site in SITES:
        for anchor in site.anchors:
            if anchor.file not in sources:
                continue
            statement = _find(trees[anchor.file], lines[anchor.file], anchor)
            if statement is not None:
                placements.append(_place(site, anchor, statement, lines[anchor.file]))
                break
        else:
            raise DhpError(f"cannot find where megatron-dhp's {site.name!r} hook ({site.why}) goes: looked for "
                           f"{' or '.join(a.describe() for a in site.anchors)}; this Megatron-LM moved it, add the "
                           f"call by hand (docs/megatron-lm.md, 'Hook sites') or use a checked version")
    return placements


def applied_sites(text: str) -> list[str]:
    """The names of the sites already inserted into this source text."""
    return [name for _, name in _MARKER_LINE.findall(text)]


def applied(sources: dict[str, str]) -> set[str]:
    """The names of the sites already inserted into any of these files (path -> source text)."""
    return {name for text in sources.values() for name in applied_sites(text)}


def insert(text: str, placements: list[Placement]) -> str:
    """`text` with the placements of its file inserted (bottom up, so line numbers stay valid)."""
    lines = text.splitlines(keepends=True)
    for p in sorted(placements, key=lambda p: p.line, reverse=True):
        lines[p.line - 1:p.line - 1] = [line + "\n" for line in p.lines]
    return "".join(lines)


def remove(text: str, path: str) -> str:
    """`text` without any inserted site; a block edited since it was inserted stops with its site's name."""
    lines = text.splitlines(keepends=True)
    by_name = {s.name: s for s in SITES}
    at = 0
    while at < len(lines):
        match = _MARKER_LINE.match(lines[at])
        if not match:
            at += 1
            continue
        indent, name = match.groups()
        site = by_name.get(name)
        blocks = [[line + "\n" for line in _block(site, a, indent)] for a in site.anchors] if site else []
        expected = next((b for b in blocks if lines[at:at + len(b)] == b), None)
        if expected is None:
            raise DhpError(f"cannot revert megatron-dhp's {name!r} hook in {path}: its lines have changed since it "
                           f"was inserted; remove the block under '{MARKER}{name}' by hand")
        del lines[at:at + len(expected)]
    return "".join(lines)


def _find(tree: ast.Module, lines: list[str], anchor: Anchor) -> ast.stmt | None:
    """The anchor's statement (the top-level one holding it, with `lift`), or None."""
    body = _scope_body(tree, anchor.scope)
    if body is None:
        return None
    for top in body:
        for statement in _simple_statements(top):
            if _is_docstring(statement):
                continue
            source = "\n".join(lines[statement.lineno - 1:statement.end_lineno])[statement.col_offset:]
            if re.search(anchor.code, source, flags=re.MULTILINE):
                return top if anchor.lift else statement
    return None


def _scope_body(tree: ast.Module, scope: str) -> list[ast.stmt] | None:
    for node in tree.body:
        if scope == MAIN and isinstance(node, ast.If) and "__main__" in ast.dump(node.test):
            return node.body
        if isinstance(node, ast.FunctionDef) and node.name == scope:
            return node.body
    return None


def _simple_statements(statement: ast.stmt):
    """The statement itself, or the simple statements inside a compound one, in source order."""
    blocks = [getattr(statement, field, None) for field in ("body", "orelse", "finalbody", "handlers")]
    if not any(isinstance(b, list) for b in blocks) or isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
        yield statement
        return
    for block in blocks:
        for inner in block or []:
            yield from _simple_statements(inner)


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)


def _place(site: Site, anchor: Anchor, statement: ast.stmt, lines: list[str]) -> Placement:
    indent = lines[statement.lineno - 1][:statement.col_offset]
    line = statement.lineno if anchor.where == "before" else statement.end_lineno + 1
    return Placement(site, anchor, line, tuple(_block(site, anchor, indent)))


def _block(site: Site, anchor: Anchor, indent: str) -> list[str]:
    code = anchor.block or site.block
    return [f"{indent}{MARKER}{site.name}: {site.why}", *textwrap.indent(code, indent).splitlines()]


def read_sources(root: Path) -> dict[str, str]:
    """The site files a checkout has (path inside it -> text)."""
    return {f: (root / f).read_text() for f in SITE_FILES if (root / f).is_file()}
