"""`megatron-dhp apply-patches`: add megatron-dhp's hooks to a Megatron-LM checkout (idempotent).

Detects the upstream tag, then `git apply`s `patches/TAG.patch`; `--check` only reports, `--revert` removes
the patch again. A tree the patch does not fit stops with the first differing file and what to do.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `apply-patches`."""
    p = sub.add_parser(
        "apply-patches",
        help="add megatron-dhp's hooks to a Megatron-LM checkout (core_v0.16.1, core_v0.19.0)",
        description="Detect the Megatron-LM tag of a checkout and git-apply megatron-dhp's patch for it "
        "(a few calls into megatron_dhp.megatron). Running it again on a patched tree does nothing.",
    )
    p.add_argument("--megatron-lm", required=True, metavar="PATH", help="the Megatron-LM checkout (holds pretrain_gpt.py)")
    p.add_argument("--check", action="store_true", help="only report whether the patch applies (or reverts) cleanly")
    p.add_argument("--revert", action="store_true", help="remove the patch instead of applying it")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Apply, check or revert; prints one line."""
    from megatron_dhp.megatron.patching import apply

    print(f"megatron-dhp apply-patches: {apply(args.megatron_lm, check=args.check, revert=args.revert)}")
    return 0
