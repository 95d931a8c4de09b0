"""Checkpoints a run resumes from exactly: weights, optimizer, schedule, data position and RNG state.

Layout of `--save DIR`:

    DIR/.lock                   the run that writes DIR (`save_lock`: one run at a time)
    DIR/latest                  name of the newest complete checkpoint (written last)
    DIR/step_000010/meta.json   step, the run's fingerprint, size and sha256 of every rank file
    DIR/step_000010/rank0.pt    this rank's state: tensors and plain containers only

Every rank writes its own file (`torch.save`; under pipeline parallelism its stage's part of the model, so
a checkpoint resumes only on the same train.pp, which is in the fingerprint); rank 0 writes `meta.json` and
then `latest`, each through a temporary file and an atomic rename, so an interrupted save never replaces a
good checkpoint, and then removes the checkpoints beyond `train.keep_checkpoints`. A write that fails on any
rank (a full disk) is agreed on over the world, so every rank stops with the same line. Loading reads
files with `torch.load(weights_only=True)` (no code runs from a checkpoint), checks each file's size and
hash and the fingerprint (model, TP, PP, world size, data) against the live run, and agrees on the outcome over
the world before anything is applied: a bad file on one rank stops every rank with a `DhpError` naming it,
except under `load: auto`, which falls back to the newest checkpoint every rank can load.
The planner is not in the fingerprint: the math is the same under any plan, so a run may resume under
another planner (its losses then agree to fp32 rounding rather than bit for bit).

At start-up rank 0, holding the lock, prepares the folder (`prepare_save_folder`): it removes what saves
cut off by a kill left (temporary files, step folders without one complete rank file), keeps and names a
step folder with complete rank files but no metadata, and refuses a fresh run into a folder holding
another run's checkpoints unless `train.overwrite` lets it remove them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron_dhp.config_io import to_mapping
from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.files import MB, parse_json, read_text
from megatron_dhp.training.config import AUTO_LOAD, RunConfig, TrainConfig

SCHEMA = "megatron-dhp/checkpoint/v1"
LATEST = "latest"
LATEST_BYTES = 4096
"""The most a `latest` file is read of (it holds one folder name)."""
STEP_FOLDER = re.compile(r"step_(\d+)")

META_BYTES = 16 * MB
"""The most a meta.json may hold (its fingerprint and one entry per rank file are a few KB): it is read whole."""

T = TypeVar("T")


class UnloadableCheckpoint(DhpError):
    """A checkpoint this rank cannot read: missing, truncated or corrupt files, or bad metadata. Unlike a
    checkpoint of another run (a fingerprint mismatch), `load: auto` falls back past it."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}; {fix}")
        self.reason = reason


def run_fingerprint(config: TrainConfig, *, world_size: int) -> dict:
    """What must match for a checkpoint to resume this run: the model, its sharding and the data."""
    data = to_mapping(config.data)
    data["truncate"] = config.dhp.truncate
    stages = {"pp": config.train.pp} if config.train.pp > 1 else {}  # PP 1 fingerprints as before: old checkpoints resume
    stages.update({"vpp": config.train.vpp} if config.train.vpp > 1 else {})
    return {"model": to_mapping(config.model), "tp": config.train.tp, **stages, "world_size": world_size, "data": data}


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """`decide()` run on rank 0 only; its result, or its `DhpError`, on every rank. Collective: a refusal
    stops every rank at once instead of leaving the others waiting for rank 0 in their next collective."""
    outcome: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = (True, decide())
        except DhpError as e:
            outcome[0] = (False, str(e))
    dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise DhpError(value)
    return value


def saved_steps(directory: Path) -> list[Path]:
    """The step folders of `directory` that hold meta.json, newest (highest step) first."""
    steps = [f for f in directory.glob("step_*") if STEP_FOLDER.fullmatch(f.name) and (f / "meta.json").is_file()]
    return sorted(steps, key=_step, reverse=True)


def latest_name(directory: Path) -> str | None:
    """The step folder `directory`'s `latest` names (None without one). Anything but the name of a step folder
    (`../run/step_000004`, an absolute path) is refused: it would resume from, roll back or save over
    checkpoints outside `directory`."""
    marker = directory / LATEST
    if not marker.is_file():
        return None
    name = read_text(marker, what="latest file", limit=LATEST_BYTES).strip()
    if not STEP_FOLDER.fullmatch(name):
        raise DhpError(f"{marker} names {excerpt(name)}, not a step folder of {directory} (step_ and a number); "
                       "write the name of the checkpoint to resume from into it, or delete it (load: auto then "
                       "resumes from the newest)")
    return name


def remove_inside(save: Path, path: Path) -> None:
    """Delete `path`, a file or a folder with what it holds, inside the `--save` folder `save`: the one way
    anything is deleted there. A link is removed as a link (never what it points to), and a path whose
    parent resolves outside `save` (through a linked folder) is refused."""
    root, parent = save.resolve(), path.parent.resolve()
    if parent != root and root not in parent.parents:
        raise DhpError(f"refusing to delete {path}: it resolves outside --save {save} (through a link); move the "
                       "link out of the save folder")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def resume_candidates(directory: Path) -> list[Path]:
    """What `load: auto` tries, in order: the folder `latest` names, then every other saved step, newest first."""
    latest = latest_name(directory)
    named = [directory / latest] if latest is not None else []
    return named + [f for f in saved_steps(directory) if f not in named]


def resume_directory(load: str | None, save: str | None) -> str | None:
    """The folder to resume from: `load`, or with `load: auto` the `save` folder when it holds a checkpoint
    (None: start fresh)."""
    if load != AUTO_LOAD:
        return load
    return save if save is not None and resume_candidates(Path(save)) else None


@dataclass(frozen=True)
class SaveFolderStart:
    """What rank 0 found and did in the `--save` folder at start-up, for every rank."""

    resume: str | None
    """The folder to resume from (None: start fresh)."""
    notes: list[str]
    """One line per thing removed, kept or replaced, for the run's log."""


def prepare_save_folder(run: RunConfig) -> SaveFolderStart:
    """Rank 0, holding the folder's lock, before any step: pick the checkpoint to resume from; for a fresh run
    refuse another run's checkpoints (which it would mix with its own) or, with `train.overwrite`, remove
    them; then clear what interrupted saves left."""
    save = Path(run.save)
    files = sorted(f.name for f in save.glob("step_*") if STEP_FOLDER.fullmatch(f.name) and not f.is_dir())
    if files:
        raise DhpError(f"--save {save} holds a file named like a step folder ({files[0]}), where a save would write "
                       "its checkpoint folder; move it away, or pass another --save")
    resume = resume_directory(run.load, run.save)
    if _within(resume, save):
        notes = _clear_after(save, Path(resume), overwrite=run.overwrite)
    else:
        notes = _clear_for_fresh_run(save, overwrite=run.overwrite)
    notes += sweep_incomplete(save)
    if run.load == AUTO_LOAD and resume is None:
        notes.append(f"load: auto found no checkpoint in {save}: starting fresh")
    return SaveFolderStart(resume, notes)


def _within(resume: str | None, save: Path) -> bool:
    """Whether the run resumes from `save` itself or one of its step folders."""
    if resume is None:
        return False
    folder, save = Path(resume).resolve(), save.resolve()
    return folder == save or save in folder.parents


def _clear_for_fresh_run(save: Path, *, overwrite: bool) -> list[str]:
    saved, latest = saved_steps(save), latest_name(save)
    if not saved and latest is None:
        return []
    if not overwrite:
        newest = f"latest {latest}" if latest is not None else f"newest {saved[0].name}, no latest"
        raise DhpError(f"--save {save} holds checkpoints of another run ({newest}); resume with --load auto, or pass "
                       "--overwrite to replace them, or another --save")
    folders = [f for f in save.glob("step_*") if f.is_dir() or f.is_symlink()]
    for folder in folders:
        remove_inside(save, folder)
    remove_inside(save, save / LATEST)
    return [f"removed {len(folders)} step folders ({len(saved)} checkpoints) and latest of another run from {save}: "
            "--overwrite"]


def _clear_after(save: Path, resume: Path, *, overwrite: bool) -> list[str]:
    """A run resumed from one of `save`'s own step folders (named, or the one `latest` names): the later
    checkpoints there belong to the run it rolls back, and kept they would be mixed with its own (`load: auto`
    and retention rank them by step). So they are refused, or with `train.overwrite` removed (and `latest`, if
    it named one)."""
    named = f"--load {resume}"
    if resume.resolve() == save.resolve():
        name = latest_name(save)
        if name is None:  # load: auto without `latest` resumes from the newest
            return []
        resume, named = save / name, f"{save / LATEST} names {name}, which"
    if not STEP_FOLDER.fullmatch(resume.name):
        return []
    later = [f for f in saved_steps(save) if _step(f) > _step(resume)]
    if not later:
        return []
    if not overwrite:
        raise DhpError(f"{named} resumes at step {_step(resume)}, but --save {save} holds later checkpoints "
                       f"of the run it rolls back ({', '.join(f.name for f in later[:3])}"
                       f"{', ...' if len(later) > 3 else ''}); pass --overwrite to remove them, or another --save")
    if latest_name(save) in {f.name for f in later}:
        remove_inside(save, save / LATEST)
    for folder in later:
        remove_inside(save, folder)
    return [f"removed {len(later)} later checkpoint{'s' * (len(later) > 1)} than {resume.name} from {save}: --overwrite"]


def _step(folder: Path) -> int:
    return int(folder.name.removeprefix("step_"))


def sweep_incomplete(directory: str | Path) -> list[str]:
    """Remove what saves cut off by a kill left in `directory`, and only that: temporary files, and step
    folders without meta.json holding nothing else than incomplete rank files (`latest` never named them).
    A step folder with complete rank files but no meta.json is kept: it may be a checkpoint whose metadata
    was lost. A link named like a step folder is left alone: no save writes one. Returns a note per folder
    removed or kept."""
    directory = Path(directory)
    notes = []
    if (directory / f"{LATEST}.tmp").is_file():
        remove_inside(directory, directory / f"{LATEST}.tmp")
        notes.append(f"removed {LATEST}.tmp from {directory}: an interrupted write")
    for link in sorted(f for f in directory.glob("step_*") if f.is_symlink()):
        notes.append(f"left {link.name} in {directory} alone: a link, which no save writes")
    for folder in sorted(f for f in directory.glob("step_*") if f.is_dir() and not f.is_symlink()):
        temporary = sorted(p for p in folder.glob("*.tmp") if not p.is_dir())
        for path in temporary:
            remove_inside(directory, path)
        complete = [p for p in folder.glob("rank*.pt") if zipfile.is_zipfile(p)]
        others = [p.name for p in folder.iterdir() if p not in complete and not re.fullmatch(r"rank\d+\.pt", p.name)]
        if (folder / "meta.json").is_file():
            notes += [f"removed {len(temporary)} temporary files from {folder}: an interrupted write"] if temporary else []
        elif not complete and not others:
            remove_inside(directory, folder)
            notes.append(f"removed {folder.name} from {directory}: an interrupted save (no meta.json, no complete "
                         "rank file)")
        else:
            held = f"{len(complete)} complete rank files" + (f" and {', '.join(sorted(others))}" if others else "")
            notes.append(f"kept {folder.name} in {directory}: {held} but no meta.json (a save cut off before its "
                         "metadata); move it away or delete it if unwanted")
    return notes


@dataclass(frozen=True)
class CheckpointMeta:
    """A checkpoint's meta.json: its step, the fingerprint of the run that saved it, and each rank file's size
    and sha256."""

    step: int
    fingerprint: object
    files: dict[str, tuple[int, str]]

    @classmethod
    def read(cls, path: Path) -> CheckpointMeta:
        """Parse and type-check every field; every rank checks all of them, so all reach the same verdict."""
        if not path.is_file():
            raise UnloadableCheckpoint(f"{str(path.parent)!r} has no meta.json (missing, or its save was cut off)",
                                       "point --load at another checkpoint")
        try:
            meta = parse_json(read_text(path, what="checkpoint metadata", limit=META_BYTES),
                              name=f"checkpoint metadata {str(path)!r}")
            if not isinstance(meta, dict):
                raise ValueError(f"a JSON {type(meta).__name__}, not an object")
            if meta.get("schema") != SCHEMA:
                raise ValueError(f"schema {excerpt(meta.get('schema'))} is not {SCHEMA!r}")
            step, files = meta.get("step"), meta.get("files")
            if type(step) is not int or step < 0:
                raise ValueError(f"step {excerpt(step)} is not a step count")
            if not isinstance(files, dict):
                raise ValueError(f"files is a JSON {type(files).__name__}, not an object of rank files")
            entries = {name: _file_entry(name, entry) for name, entry in files.items()}
        except DhpError as e:  # too large, not text, not JSON, gone since: named by the reader
            raise UnloadableCheckpoint(str(e), "point --load at another checkpoint") from None
        except (OSError, ValueError) as e:
            raise _unreadable(path, e) from None
        return cls(step, meta.get("fingerprint"), entries)


def _file_entry(name: str, entry: object) -> tuple[int, str]:
    size, digest = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
    if type(size) is not int or size < 0 or not isinstance(digest, str):
        raise ValueError(f"files[{excerpt(name)}] = {excerpt(entry)} is not {{'bytes': count, 'sha256': hex digest}}")
    return size, digest


def _unreadable(meta_path: Path, problem: object) -> UnloadableCheckpoint:
    return UnloadableCheckpoint(f"checkpoint metadata {str(meta_path)!r} is unreadable ({problem})",
                                "point --load at another checkpoint")


class Checkpointer:
    """Saves and loads this rank's part of a run's checkpoints (collective: every rank calls the same)."""

    def __init__(self, config: TrainConfig, *, world_size: int) -> None:
        self.fingerprint = run_fingerprint(config, world_size=world_size)
        self.world_size = world_size
        self.keep = config.train.keep_checkpoints
        self.fall_back = config.train.load == AUTO_LOAD
        self.notes: list[str] = []
        """What loading found: a note per newer checkpoint `load: auto` could not load before the one it resumed
        from, and the schedule's values that the config changed."""

    def save(self, directory: str | Path, step: int, model, optimizer, scheduler) -> Path:
        """Write the state after `step` completed steps; returns the checkpoint folder."""
        folder = Path(directory) / f"step_{step:06d}"
        rank = dist.get_rank()
        weights = [chunk.state_dict() for chunk in model] if isinstance(model, list) else model.state_dict()
        state = {"step": step, "rank": rank, "model": weights, "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": _rng_state()}
        path = folder / f"rank{rank}.pt"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, lambda f: torch.save(state, f))
            entry: object = (path.name, path.stat().st_size, _sha256(path))
        except Exception as e:  # noqa: BLE001 - agreed on below: no rank may wait in the gather for this one
            entry = _write_failure(e, folder, rank, _nbytes(state))
        entries: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(entries, entry)
        failures = [e for e in entries if isinstance(e, str)]
        if failures:
            remove_inside(folder.parent, path)  # of no use without the meta.json this save cannot write
            raise DhpError(failures[0])
        decided_on_rank0(lambda: self._publish(folder, entries))
        return folder

    def _publish(self, folder: Path, entries: list) -> None:
        """Rank 0: meta.json, then `latest`, then remove the checkpoints beyond the newest `keep`."""
        step = _step(folder)
        files = {name: {"bytes": size, "sha256": digest} for name, size, digest in entries}
        meta = json.dumps({"schema": SCHEMA, "step": step, "fingerprint": self.fingerprint, "files": files},
                          indent=1).encode()
        try:
            _atomic_write(folder / "meta.json", lambda f: f.write(meta))
            _atomic_write(folder.parent / LATEST, lambda f: f.write(folder.name.encode()))
        except OSError as e:
            raise DhpError(_write_failure(e, folder, 0, len(meta))) from None
        for old in saved_steps(folder.parent)[self.keep:] if self.keep else []:
            if old != folder:
                with contextlib.suppress(OSError):  # a folder that will not go is only kept longer
                    remove_inside(folder.parent, old)

    def load(self, directory: str | Path, model, optimizer, scheduler) -> int:
        """Restore the newest checkpoint of `directory` (or the checkpoint folder itself); returns its step.
        Under `load: auto` a checkpoint that some rank cannot read is passed over for the next newest."""
        directory = Path(directory)
        candidates = decided_on_rank0(lambda: resume_candidates(directory)) if self.fall_back else [directory]
        passed: list[tuple[str, str]] = []
        for folder in candidates:
            try:
                step, state = self._read(folder if self.fall_back else _checkpoint_folder(folder))
                verdict = None
            except UnloadableCheckpoint as e:
                verdict = (str(e), e.reason)
            except DhpError as e:  # another run's checkpoint: falling back would hide it
                verdict = (str(e), None)
            verdicts: list[object] = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, verdict)
            problem = _agreed_problem(verdicts)
            if problem is None:
                self.notes = [f"{name} cannot be loaded ({why}): resumed from {folder.name}" for name, why in passed]
                self.notes += self._apply(state, model, optimizer, scheduler)
                return step
            message, reason = problem
            if reason is None or not self.fall_back:
                raise DhpError(message)
            passed.append((folder.name, reason))
        raise DhpError(f"no checkpoint in {str(directory)!r} can be loaded ("
                       + "; ".join(f"{name}: {why}" for name, why in passed)
                       + f"); move {directory} away or pass another --save to start afresh")

    def _apply(self, state: dict, model, optimizer, scheduler) -> list[str]:
        """Load `state`; returns the schedule's notes (`load_optimizer_state`)."""
        from megatron_dhp.training.model import load_optimizer_state

        for chunk, weights in zip(model, state["model"]) if isinstance(model, list) else [(model, state["model"])]:
            chunk.load_state_dict(weights, strict=True)
        notes = load_optimizer_state(optimizer, scheduler, state["optimizer"], state["scheduler"])
        _set_rng_state(state["rng"])
        return notes

    def _read(self, folder: Path) -> tuple[int, dict]:
        """This rank's checked state of the checkpoint in `folder`, or a `DhpError` that names the file and the fix."""
        meta_path = folder / "meta.json"
        meta = CheckpointMeta.read(meta_path)
        _check_fingerprint(meta.fingerprint, self.fingerprint, meta_path)
        unlisted = [f"rank{r}.pt" for r in range(self.world_size) if f"rank{r}.pt" not in meta.files]
        if unlisted:
            raise _unreadable(meta_path, f"files lists no {unlisted[0]}")
        rank = dist.get_rank()
        path = folder / f"rank{rank}.pt"
        size, digest = meta.files[path.name]
        if not path.is_file():
            raise UnloadableCheckpoint(f"checkpoint file {str(path)!r} is missing",
                                       "the checkpoint is incomplete, point --load at another one")
        if path.stat().st_size != size or _sha256(path) != digest:
            raise UnloadableCheckpoint(f"checkpoint file {str(path)!r} is corrupt or truncated (size or sha256 "
                                       f"differs from {str(meta_path)!r})",
                                       "point --load at an earlier checkpoint or re-run from scratch")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise UnloadableCheckpoint(f"checkpoint file {str(path)!r} cannot be read ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''})",
                                       "point --load at another checkpoint") from None
        if state.get("step") != meta.step or state.get("rank") != rank:
            raise UnloadableCheckpoint(f"checkpoint file {str(path)!r} holds step {state.get('step')} of rank "
                                       f"{state.get('rank')}, not step {meta.step} of rank {rank}",
                                       "it was copied from another checkpoint")
        return meta.step, state


def _agreed_problem(verdicts: list) -> tuple[str, str | None] | None:
    """The world's verdict on a checkpoint from each rank's (message, reason to fall back or None): None when
    every rank can load it; else the lowest failing rank's, named unless every rank failed alike (bad
    metadata is every rank's), and a reason to fall back only when no rank saw another run's checkpoint."""
    failed = [(rank, v) for rank, v in enumerate(verdicts) if v is not None]
    if not failed:
        return None
    rank, (message, reason) = failed[0]
    if len(failed) < len(verdicts) or any(v != failed[0][1] for _, v in failed):
        message, reason = f"rank {rank} cannot load the checkpoint: {message}", f"rank {rank}: {reason}"
    return message, reason if all(why is not None for _, (_, why) in failed) else None


def _checkpoint_folder(directory: Path) -> Path:
    """The checkpoint a `--load DIR` names: DIR itself when it is one, else the one its `latest` names."""
    return directory if (directory / "meta.json").is_file() else _latest(directory)


def _latest(directory: Path) -> Path:
    marker = directory / LATEST
    if not marker.is_file() and any(directory.glob("rank*.pt*")):
        raise DhpError(f"checkpoint {str(directory)!r} is incomplete (no meta.json: its save was interrupted); "
                       f"load {str(directory.parent)!r} to resume from the latest complete checkpoint")
    if not marker.is_file():
        raise DhpError(f"no checkpoint in {str(directory)!r} (no 'latest' file); pass the --save folder of a run "
                       "that saved at least once")
    folder = directory / latest_name(directory)
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
            diff = sorted(k for k in ours[key] if saved.get(k) != ours[key][k]) if (
                isinstance(saved, dict) and isinstance(ours[key], dict)) else []
            if diff:
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


def _atomic_write(path: Path, write: Callable) -> None:
    """Write `path` through a temporary file and an atomic rename; a failed write leaves neither behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_failure(error: BaseException, folder: Path, rank: int, needed: int) -> str:
    """The one line every rank stops with when `rank` could not write its part of the save into `folder`."""
    cause = error
    while cause is not None and not isinstance(cause, OSError):  # torch.save wraps its file's error
        cause = cause.__cause__ or cause.__context__
    latest = latest_name(folder.parent)
    kept = (f"latest still names {latest}" if latest is not None else
            f"{folder.parent} holds no complete checkpoint of this run yet")
    if cause is not None and cause.errno == errno.ENOSPC:
        free = shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists())).free
        return (f"no space left on device writing {folder} (rank {rank} needs about {_mb(needed)}, {_mb(free)} "
                f"free); free space or point --save at another disk; {kept}")
    problem = cause if cause is not None else f"{type(error).__name__}: {error}"
    return f"cannot write {folder} (rank {rank}: {problem}); point --save at a folder this run can write; {kept}"


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _nbytes(state: object) -> int:
    """The bytes of the tensors in `state` (nested dicts and lists): about what its file takes."""
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_nbytes(v) for v in state)
    return 0
