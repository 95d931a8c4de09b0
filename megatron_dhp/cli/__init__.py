"""The `megatron-dhp` command: one sub-command per module, each with its own `--help`.

A sub-command module defines `add_parser(subparsers)` and `run(args) -> int`, and imports anything heavy
(torch, megatron.core, matplotlib) inside `run` so that `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_dhp import __version__
from megatron_dhp.errors import DhpError, DhpStopped, excerpt

COMMANDS = {
    "plan": "megatron_dhp.cli.plan_cmd",
    "simulate": "megatron_dhp.cli.simulate_cmd",
    "dists": "megatron_dhp.cli.dists_cmd",
    "selftest": "megatron_dhp.cli.selftest_cmd",
    "apply-patches": "megatron_dhp.cli.apply_patches_cmd",
    "train": "megatron_dhp.cli.train_cmd",
    "profile": "megatron_dhp.cli.profile_cmd",
    "demo": "megatron_dhp.cli.demo_cmd",
    "doctor": "megatron_dhp.cli.doctor_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="megatron-dhp",
        description="Dynamic hybrid parallelism for Megatron-Core: plan, simulate and run per-step CP groups.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the sub-command; a `DhpError`, or the operating system refusing a path the user gave
    (a name too long, a folder that is a file, no permission), becomes one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except DhpStopped as e:
        print(f"megatron-dhp {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except DhpError as e:
        print(f"megatron-dhp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:
            raise
        print(f"megatron-dhp {args.command}: error: {excerpt(str(e.filename))}: {e.strerror or e}; give a path this "
              "system accepts", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megatron-dhp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
