"""What each fault does to a running `megatron-dhp train` job, and how long it takes to end.

Starts a tiny two-rank job (saving every step, rank 1 slowed so a step is in flight), waits for its first
checkpoint, then: SIGTERM to the launcher (also under `--pp 2`), SIGKILL to rank 1, SIGSTOP to rank 1 (with
`train.timeout_s` = 10), SIGKILL to the launcher. Prints per fault the exit status, seconds from the fault to
the launcher's exit and to the last rank gone, the checkpoint `latest` names, and the message. Linux only
(reads child processes from /proc).

    python bench/faults.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from megatron_dhp.launch.parent import alive, children, wait_until
from megatron_dhp.training.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
FAULTS = {  # name -> (what is signalled, signal, extra train flags, run overrides)
    "SIGTERM to the launcher": ("launcher", signal.SIGTERM, (), {}),
    "SIGTERM to the launcher, PP 2": ("launcher", signal.SIGTERM, ("--pp", "2"), {}),
    "SIGKILL to rank 1": ("rank", signal.SIGKILL, (), {}),
    "SIGSTOP to rank 1 (timeout_s 10)": ("rank", signal.SIGSTOP, (), {"timeout_s": 10}),
    "SIGKILL to the launcher": ("launcher", signal.SIGKILL, (), {}),
}


def tiny_job(folder: Path, **run: object) -> Path:
    """The two-rank tiny GPT of the tests, saving every step into folder/ckpt, as a YAML file."""
    config = TrainConfig.load("demo_cpu").with_overrides(
        train={"steps": 200, "nproc": 2, "save": str(folder / "ckpt"), "save_interval": 1, **run},
        dhp={"adaptive": False})
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def run_fault(name: str, folder: Path) -> dict:
    target, sig, flags, run = FAULTS[name]
    config = tiny_job(folder, **run)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_dhp", "train", "--config", str(config), "--quiet",
                             "--slow-rank", "1:4.0", *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    latest = folder / "ckpt" / "latest"
    if not wait_until(latest.is_file, 300):
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"{name}: no checkpoint within 300 s")
    ranks = children(proc.pid)
    began = time.monotonic()
    os.kill(proc.pid if target == "launcher" else ranks[1], sig)
    out, err = proc.communicate(timeout=300)
    exited = time.monotonic() - began
    wait_until(lambda: not any(alive(r) for r in ranks), 30)
    gone = time.monotonic() - began
    said = [line.strip() for line in (out + err).splitlines() if "stopped by" in line or "error:" in line or "then failed" in line]
    return {"fault": name, "exit": proc.returncode, "exit_s": exited, "ranks_gone_s": gone,
            "latest": latest.read_text().strip(), "message": " ".join(said)[:240]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(FAULTS):
            folder = Path(tmp) / str(k)
            folder.mkdir()
            rows.append(run_fault(name, folder))
    table = Table(title="faults on a running 2-rank `megatron-dhp train` job")
    for column in ("fault", "exit", "to exit", "ranks gone", "latest", "message"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["fault"], str(r["exit"]), f"{r['exit_s']:.1f} s", f"{r['ranks_gone_s']:.1f} s", r["latest"],
                      escape(r["message"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
