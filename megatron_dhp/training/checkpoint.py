"""Checkpoints a run resumes from exactly: weights, optimizer, schedule, data position and RNG state.

Layout of `--save DIR`:

    DIR/latest                  name of the newest complete checkpoint (written last)
    DIR/step_000010/meta.json   step, the run's fingerprint, size and sha256 of every rank file
    DIR/step_000010/rank0.pt    this rank's state: tensors and plain containers only

Every rank writes its own file (`torch.save`; under pipeline parallelism its stage's part of the model, so
a checkpoint resumes only on the same train.pp, which is in the fingerprint); rank 0 writes `meta.json` and
then `latest`, each through a temporary file and an atomic rename, so an interrupted save never replaces a
good checkpoint. Loading reads
files with `torch.load(weights_only=True)` (no code runs from a checkpoint), checks each file's size and
hash and the fingerprint (model, TP, PP, world size, data) against the live run, and agrees on the outcome over
the world before anything is applied: a bad file on one rank stops every rank with a `DhpError` naming it.
The planner is not in the fingerprint: the math is the same under any plan, so a run may resume under
another planner (its losses then agree to fp32 rounding rather than bit for bit).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dhp.config_io import to_mapping
from megatron_dhp.errors import DhpError
from megatron_dhp.training.config import AUTO_LOAD, TrainConfig

SCHEMA = "megatron-dhp/checkpoint/v1"


def run_fingerprint(config: TrainConfig, *, world_size: int) -> dict:
    """What must match for a checkpoint to resume this run: the model, its sharding and the data."""
    data = to_mapping(config.data)
    data["truncate"] = config.dhp.truncate
    stages = {"pp": config.train.pp} if config.train.pp > 1 else {}  # PP 1 fingerprints as before: old checkpoints resume
    stages.update({"vpp": config.train.vpp} if config.train.vpp > 1 else {})
    return {"model": to_mapping(config.model), "tp": config.train.tp, **stages, "world_size": world_size, "data": data}


def resume_directory(load: str | None, save: str | None) -> str | None:
    """The folder to resume from: `load`, or with `load: auto` the `save` folder when it holds a checkpoint
    (None: start fresh)."""
    if load != AUTO_LOAD:
        return load
    return save if save is not None and (Path(save) / "latest").is_file() else None


def sweep_incomplete(directory: str | Path) -> list[str]:
    """Remove the step folders of `directory` that have no meta.json (saves cut off by a kill: a temporary
    or partial rank file, never loaded since `latest` still names an older step); returns their names."""
    swept = []
    for folder in sorted(Path(directory).glob("step_*")):
        if folder.is_dir() and not (folder / "meta.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            swept.append(folder.name)
    return swept


class Checkpointer:
    """Saves and loads this rank's part of a run's checkpoints (collective: every rank calls the same)."""

    def __init__(self, config: TrainConfig, *, world_size: int) -> None:
        self.fingerprint = run_fingerprint(config, world_size=world_size)

    def save(self, directory: str | Path, step: int, model, optimizer, scheduler) -> Path:
        """Write the state after `step` completed steps; returns the checkpoint folder."""
        folder = Path(directory) / f"step_{step:06d}"
        rank = dist.get_rank()
        folder.mkdir(parents=True, exist_ok=True)
        weights = [chunk.state_dict() for chunk in model] if isinstance(model, list) else model.state_dict()
        state = {"step": step, "rank": rank, "model": weights, "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": _rng_state()}
        path = folder / f"rank{rank}.pt"
        _atomic_write(path, lambda f: torch.save(state, f))
        entries: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(entries, (path.name, path.stat().st_size, _sha256(path)))
        if rank == 0:
            files = {name: {"bytes": size, "sha256": digest} for name, size, digest in entries}
            meta = {"schema": SCHEMA, "step": step, "fingerprint": self.fingerprint, "files": files}
            _atomic_write(folder / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
            _atomic_write(Path(directory) / "latest", lambda f: f.write(folder.name.encode()))
        dist.barrier()
        return folder

    def load(self, directory: str | Path, model, optimizer, scheduler) -> int:
        """Restore the newest checkpoint of `directory` (or the checkpoint folder itself); returns its step."""
        try:
            step, state = self._read(Path(directory))
            problem = None
        except DhpError as e:
            step, state, problem = 0, None, str(e)
        verdicts: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
        if problem is not None:
            raise DhpError(problem)
        bad = [r for r, p in enumerate(verdicts) if p is not None]
        if bad:
            raise DhpError(f"rank {bad[0]} cannot load the checkpoint: {verdicts[bad[0]]}")
        for chunk, weights in zip(model, state["model"]) if isinstance(model, list) else [(model, state["model"])]:
            chunk.load_state_dict(weights, strict=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        return step

    def _read(self, directory: Path) -> tuple[int, dict]:
        """This rank's checked state, or a `DhpError` that names the file and the fix."""
        folder = directory if (directory / "meta.json").is_file() else _latest(directory)
        meta_path = folder / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
            step, files = int(meta["step"]), meta["files"]
            if meta.get("schema") != SCHEMA:
                raise ValueError(f"schema {meta.get('schema')!r} is not {SCHEMA!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DhpError(f"checkpoint metadata {str(meta_path)!r} is unreadable ({e}); "
                           "point --load at another checkpoint") from None
        _check_fingerprint(meta.get("fingerprint"), self.fingerprint, meta_path)
        name = f"rank{dist.get_rank()}.pt"
        path = folder / name
        expected = files.get(name)
        if expected is None or not path.is_file():
            raise DhpError(f"checkpoint file {str(path)!r} is missing; the checkpoint is incomplete, "
                           "point --load at another one")
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            raise DhpError(f"checkpoint file {str(path)!r} is corrupt or truncated (size or sha256 differs from "
                           f"{str(meta_path)!r}); point --load at an earlier checkpoint or re-run from scratch")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise DhpError(f"checkpoint file {str(path)!r} cannot be read ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); point --load at another checkpoint") from None
        if state.get("step") != step or state.get("rank") != dist.get_rank():
            raise DhpError(f"checkpoint file {str(path)!r} holds step {state.get('step')} of rank "
                           f"{state.get('rank')}, not step {step} of rank {dist.get_rank()}; it was copied "
                           "from another checkpoint")
        return step, state


def _latest(directory: Path) -> Path:
    marker = directory / "latest"
    if not marker.is_file() and any(directory.glob("rank*.pt*")):
        raise DhpError(f"checkpoint {str(directory)!r} is incomplete (no meta.json: its save was interrupted); "
                       f"load {str(directory.parent)!r} to resume from the latest complete checkpoint")
    if not marker.is_file():
        raise DhpError(f"no checkpoint in {str(directory)!r} (no 'latest' file); pass the --save folder of a run "
                       "that saved at least once")
    folder = directory / marker.read_text().strip()
    if not (folder / "meta.json").is_file():
        raise DhpError(f"{str(marker)!r} names {folder.name!r}, which has no meta.json; the checkpoint folder "
                       "was removed or renamed")
    return folder


def _check_fingerprint(theirs: object, ours: dict, meta_path: Path) -> None:
    if theirs == ours:
        return
    for key in ours:
        saved = theirs.get(key) if isinstance(theirs, dict) else None
        if saved != ours[key]:
            if isinstance(saved, dict) and isinstance(ours[key], dict):
                diff = sorted(k for k in ours[key] if saved.get(k) != ours[key][k])
                key, saved, now = f"{key}.{diff[0]}", saved.get(diff[0]), ours[key][diff[0]]
            else:
                now = ours[key]
            raise DhpError(f"checkpoint {str(meta_path.parent)!r} was saved with {key} = {saved!r} but this run has "
                           f"{now!r}; resume with the saved settings or start a fresh run without --load")
    raise DhpError(f"checkpoint {str(meta_path.parent)!r} was saved by a different run; start without --load")


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
