"""One run per output: `lock_folder` takes an exclusive lock on the output for the whole run, so that a second run
into the same folder is refused at once, naming the process that holds it. The lock is a `flock` on `.NAME.lock`
beside the folder (inside it when the folder is a mount point), which holds the holder's pid, host and command; the
system releases it when the holder dies, so a stale lock file is simply taken over.
"""

import atexit
import errno
import functools
import os
import shlex
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from .paths import is_mount_point, resolved
from .recovery import restore_every_set_aside


try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs are not guarded against each other there
    fcntl = None


class FolderInUseError(RuntimeError):
    """Another process is writing the same output."""


class FolderLock:
    """An exclusive `flock` on the lock file of one output, held by this process (see `lock_folder`)."""

    def __init__(self, target: Path, path: Path, descriptor: int):
        self.target, self.path, self.descriptor, self.holds = target, path, descriptor, 1

    def release(self) -> None:
        self.holds -= 1
        if self.holds > 0 or self.descriptor < 0:
            return
        try:
            os.unlink(self.path)  # while still locked: a process that opened it now finds it gone and opens anew
        except OSError:
            pass
        os.close(self.descriptor)
        self.descriptor = -1
        _HELD.pop(self.target, None)


_HELD: dict[Path, FolderLock] = {}


def _lock_file(target: Path) -> Path:
    """`.NAME.lock` beside `target`; inside it for a mount point or a folder whose parent is not writable."""
    beside = target.parent / f".{target.name}.lock"
    if target.is_dir() and (is_mount_point(target) or not os.access(target.parent, os.W_OK)):
        return target / beside.name
    return beside


def _holder() -> str:
    command = " ".join(shlex.quote(part) for part in [os.path.basename(sys.executable), *sys.argv])
    return f"process {os.getpid()} on {socket.gethostname()} ({command})"


def lock_folder(target: str | os.PathLike) -> FolderLock:
    """Take the exclusive lock on the output `target` (links resolved) for this process, or raise `FolderInUseError`
    naming the process that holds it. Taking it again in the same process adds a hold (released by `release`); a
    process that dies releases its locks, so a lock file left by a killed run is taken over."""
    target = resolved(target)
    held = _HELD.get(target)
    if held is not None:
        held.holds += 1
        return held
    path = _lock_file(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            break
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(descriptor)
                raise
            holder = os.read(descriptor, 4096).decode("utf-8", "replace").strip() or "another process"
            os.close(descriptor)
            raise FolderInUseError(
                f"{target} is being written by {holder} (lock file {path}). Wait for that run to end, or choose "
                "another output folder."
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                break  # the file we locked is still the lock file (a finished holder deletes it)
        except FileNotFoundError:
            pass
        os.close(descriptor)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, (_holder() + "\n").encode(), 0)
    lock = _HELD[target] = FolderLock(target, path, descriptor)
    return lock


def releases_folder_locks(function: Callable) -> Callable:
    """Decorate a script's `main`: the output locks it takes are released when it returns or raises (called from a
    test or another script, the process goes on); when it raises, old checkpoints it set aside are put back."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        before = set(_HELD)
        try:
            return function(*args, **kwargs)
        except BaseException:
            restore_every_set_aside()
            raise
        finally:
            for target in set(_HELD) - before:
                lock = _HELD[target]
                lock.holds = 1
                lock.release()

    return wrapper


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        lock.holds = 1
        lock.release()
