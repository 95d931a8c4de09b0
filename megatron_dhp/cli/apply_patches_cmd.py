"""`megatron-dhp apply-patches`: add megatron-dhp's hooks to a Megatron-LM checkout (idempotent).

Each hook is found by its code (`megatron/sites.py`), so any Megatron-LM from core_v0.16.1 to main and dev
takes them; `--check` only reports, `--revert` removes them, `--diff` prints them as a patch instead.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `apply-patches`."""
    p = sub.add_parser(
        "apply-patches",
        help="add megatron-dhp's hooks to a Megatron-LM checkout (core_v0.16.1 through main and dev)",
        description="Insert megatron-dhp's calls into a Megatron-LM checkout, each found by the code it follows "
        "(not by line numbers). Running it again on a hooked tree does nothing. Without touching the "
        "checkout, `python -m megatron_dhp.megatron.run pretrain_gpt.py FLAGS` makes the same edits in memory.",
    )
    p.add_argument("--megatron-lm", required=True, metavar="PATH", help="the Megatron-LM checkout (holds pretrain_gpt.py)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report whether the hooks go in (or come out) cleanly")
    mode.add_argument("--diff", action="store_true", help="print the hooks as a unified diff (git apply) instead")
    p.add_argument("--revert", action="store_true", help="remove the hooks instead of adding them")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Apply, check, revert or print; prints one line (or the diff)."""
    from megatron_dhp.megatron.patching import apply, diff

    if args.diff:
        print(diff(args.megatron_lm), end="")
        return 0
    print(f"megatron-dhp apply-patches: {apply(args.megatron_lm, check=args.check, revert=args.revert)}")
    return 0
