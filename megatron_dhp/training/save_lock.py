"""One run at a time per `--save` folder: rank 0 holds `DIR/.lock` from start-up to the end of the run.

Two runs saving into one folder would interleave their step folders and overwrite each other's `latest`,
so the second is refused before it builds anything. The lock is a file created with O_EXCL (atomic on local
filesystems and NFSv3+) that says who holds it. A run killed outright (SIGKILL, a lost node) cannot remove
it, so a lock of this host whose process is gone, or whose pid now belongs to a process started later, is
stale and replaced. Creating it is also the start-up check that `--save` can be written at all: an
unwritable folder is refused before the first step instead of failing at the first save.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from megatron_dhp.errors import DhpError

LOCK_NAME = ".lock"

LOCK_BYTES = 4096
"""The most a lock record is read of (one is about 100 characters): a lock file is never read whole."""
READ_TRIES = 10
"""Reads of a lock that is still empty (its run created it and is writing it) before it counts as unreadable."""


@dataclass(frozen=True)
class LockRecord:
    """Who holds a save folder: enough to tell a live run from one that is gone."""

    host: str
    pid: int
    process_start: int | None
    """The process's start time (clock ticks after boot, field 22 of /proc/<pid>/stat; None without /proc):
    a pid reused by a later process has another."""
    since: str
    """When the run took the lock (local time), for the message that refuses another run."""

    @classmethod
    def of_this_process(cls) -> LockRecord:
        """This process, taking the lock now."""
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()),
                   datetime.now().isoformat(sep=" ", timespec="seconds"))

    @classmethod
    def read(cls, path: Path) -> LockRecord:
        """The record in `path`; ValueError or TypeError when it is not one, OSError when it cannot be read."""
        with open(path, encoding="utf-8") as f:
            text = f.read(LOCK_BYTES + 1)
        if len(text) > LOCK_BYTES:
            raise ValueError(f"{str(path)!r} holds more than {LOCK_BYTES} characters, not a lock record")
        return cls(**json.loads(text))

    def is_alive(self) -> bool | None:
        """Whether the holding process still runs; None when this host cannot tell (another host's lock)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: it exists
            pass
        return process_start(self.pid) == self.process_start


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name in (...) may hold spaces


class SaveLock:
    """The lock of one `--save` folder, taken and released by rank 0."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.mine = LockRecord.of_this_process()

    def acquire(self) -> list[str]:
        """Take the lock (creating the folder); returns notes on a stale lock it replaced. Raises `DhpError`
        when another live run holds it or the folder cannot be written."""
        notes = []
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._unwritable(e) from None
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # released since: try again
                    continue
                if holder.is_alive() is not False:
                    raise self._in_use(holder) from None
                if self._break(holder):
                    notes.append(f"replaced the stale lock of {self.directory} (pid {holder.pid} on {holder.host} "
                                 f"since {holder.since} is no longer running)")
                continue
            except OSError as e:
                raise self._unwritable(e) from None
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(asdict(self.mine)))
            except OSError as e:
                self.path.unlink(missing_ok=True)
                raise self._unwritable(e) from None
            return notes

    def release(self) -> None:
        """Remove the lock if it is still this run's (never one that another run took over as stale)."""
        try:
            if LockRecord.read(self.path) == self.mine:
                self.path.unlink()
        except (OSError, ValueError, TypeError):  # removed or replaced meanwhile: nothing of ours to remove
            pass

    def _break(self, stale: LockRecord) -> bool:
        """Remove the lock `stale`; False when another run changed it first. Two runs may find the same stale
        lock: it is moved aside and read back before removal, so the slower never removes the lock the faster
        has taken since (it puts that back)."""
        aside = self.path.with_name(f"{LOCK_NAME}.{self.mine.pid}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise self._unwritable(e) from None
        try:
            moved = LockRecord.read(aside)
        except (OSError, ValueError, TypeError):  # a new lock, not yet written
            moved = None
        if moved != stale:
            os.rename(aside, self.path)
            return False
        aside.unlink()
        return True

    def _holder(self) -> LockRecord | None:
        """The record of the lock another run holds (None: released meanwhile); that run may still be writing
        it just after creating it."""
        for attempt in range(READ_TRIES):
            try:
                return LockRecord.read(self.path)
            except FileNotFoundError:
                return None
            except (OSError, ValueError, TypeError) as e:
                problem = e
                time.sleep(0.1 * (attempt + 1))
        raise DhpError(f"--save {self.directory} is locked by {self.path}, which cannot be read ({problem}); "
                       f"delete it if no run uses {self.directory}")

    def _in_use(self, holder: LockRecord) -> DhpError:
        where = f"the run of pid {holder.pid} on host {holder.host} since {holder.since}"
        if holder.host == self.mine.host:
            return DhpError(f"--save {self.directory} is in use by {where}; wait for it, or pass another --save")
        return DhpError(f"--save {self.directory} is in use by {where} (another host: this one cannot tell whether it "
                        f"still runs); wait for it, or pass another --save, or delete {self.path} if that run is gone")

    def _unwritable(self, error: OSError) -> DhpError:
        return DhpError(f"--save {self.directory} cannot be written ({error.strerror or error}: "
                        f"{error.filename or self.path}); pass a folder this user can write")
