"""One run at a time per `--save` folder: rank 0 holds an exclusive `flock` on `DIR/.lock` from start-up to the
end of the run.

Two runs saving into one folder would interleave their step folders and overwrite each other's `latest`,
so the second is refused before it builds anything. The kernel releases a `flock` when its holder ends, however
it ends (SIGKILL, Ctrl-C, the out-of-memory killer), and the lock lives on the file, not on a pid: no lock is
ever stale, whatever PID namespace each run is in (containers sharing a host name), and none is guessed from
pids. Linux takes a `flock` on NFS as a lock the server holds (released when the holder's lease ends). The
file names who holds it, for the message that refuses another run; a file nobody holds a lock on is no lock.
Opening it is also the start-up check that `--save` can be written at all: an unwritable folder is refused
before the first step instead of failing at the first save.
"""

from __future__ import annotations

import fcntl
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
"""Reads of a held lock's record that is still empty (its run took the lock and is writing it) before the
refusal goes without the holder's name."""


@dataclass(frozen=True)
class LockRecord:
    """Who holds a save folder, for the message that refuses another run."""

    host: str
    pid: int
    since: str
    """When the run took the lock (local time)."""

    @classmethod
    def of_this_process(cls) -> LockRecord:
        """This process, taking the lock now."""
        return cls(socket.gethostname(), os.getpid(), datetime.now().isoformat(sep=" ", timespec="seconds"))

    @classmethod
    def read(cls, path: Path) -> LockRecord:
        """The record in `path`; ValueError or TypeError when it is not one, OSError when it cannot be read."""
        with open(path, encoding="utf-8") as f:
            text = f.read(LOCK_BYTES + 1)
        if len(text) > LOCK_BYTES:
            raise ValueError(f"{str(path)!r} holds more than {LOCK_BYTES} characters, not a lock record")
        return cls(**json.loads(text))

    def describe(self) -> str:
        """Who, in the words of a message."""
        return f"the run of pid {self.pid} on host {self.host} since {self.since}"


class SaveLock:
    """The lock of one `--save` folder, taken and released by rank 0."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.mine = LockRecord.of_this_process()
        self._fd: int | None = None

    def acquire(self) -> list[str]:
        """Take the lock (creating the folder); returns a note when the file names a run that ended without
        removing it. Raises `DhpError` when another run holds it or the folder cannot be written."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._unwritable(e) from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise self._unwritable(e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._in_use() from None
            except OSError as e:
                os.close(fd)
                raise DhpError(f"--save {self.directory} cannot be locked ({e.strerror or e}: {self.path}); pass a "
                               "folder on a filesystem with file locks") from None
            if self._still_the_file(fd):
                break
            os.close(fd)  # its holder removed it between our open and our lock: lock the new one
        self._fd = fd
        notes = []
        try:
            left = LockRecord.read(self.path)
            notes.append(f"took over {self.path} from {left.describe()}, which ended without removing it")
        except (OSError, ValueError, TypeError):  # new, empty or not a record: nothing to say
            pass
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(self.mine)).encode(), 0)
        except OSError as e:
            self.release()
            raise self._unwritable(e) from None
        return notes

    def release(self) -> None:
        """Remove the file and drop the lock (the file first: a run that opens it meanwhile finds its lock on a
        removed file and opens the new one)."""
        if self._fd is None:
            return
        if self._still_the_file(self._fd):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def _still_the_file(self, fd: int) -> bool:
        """Whether `fd` is still the file at `self.path`."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
        except FileNotFoundError:
            return False

    def _in_use(self) -> DhpError:
        """The refusal, naming the holder once it has written its record."""
        for attempt in range(READ_TRIES):
            try:
                where = LockRecord.read(self.path).describe()
                break
            except (OSError, ValueError, TypeError):
                time.sleep(0.1 * (attempt + 1))
        else:
            where = f"another run (its record in {self.path} cannot be read)"
        return DhpError(f"--save {self.directory} is in use by {where}; wait for it, or pass another --save")

    def _unwritable(self, error: OSError) -> DhpError:
        return DhpError(f"--save {self.directory} cannot be written ({error.strerror or error}: "
                        f"{error.filename or self.path}); pass a folder this user can write")
