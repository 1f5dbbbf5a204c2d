"""Write a folder so that a crash, a full disk or a kill never leaves a half-written one at its final path.

A folder is written beside its destination under a temporary name, then renamed into place (a rename within one file
system is atomic). An existing folder is first renamed aside and deleted only once the new one is in place. The
temporary names say what they are and which process made them, `.NAME.KIND-PID-RANDOM` (KIND: `converting`,
`saving`, `previous`), so that the next run can clean up after a killed one (`recover_interrupted`): put a folder that
was set aside back when the new one never arrived, and delete half-written ones. Folders of a process that is still
running are left alone.

Used by `convert_rannet_checkpoint` and by the training scripts' final save (`scripts/training_utils.py`).
"""

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["LEFTOVER_KINDS", "normal_permissions", "recover_interrupted", "replace_folder", "staging_folder"]

LEFTOVER_KINDS = ("converting", "saving", "previous")


def _never(name: str) -> bool:
    return False


def staging_folder(target: Path, kind: str) -> Path:
    """A new, empty folder beside `target` named `.NAME.KIND-PID-RANDOM`."""
    if kind not in LEFTOVER_KINDS:
        raise ValueError(f"kind must be one of {LEFTOVER_KINDS}, got {kind!r}")
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-{os.getpid()}-", dir=target.parent))


def normal_permissions(folder: Path) -> None:
    """Give `folder` and everything in it the permissions a plain `mkdir` / `open` would (0777 / 0666 less the
    umask): temporary folders are created 0700 and some writers make their files 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, directories, files in os.walk(folder):
        for name in directories:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def replace_folder(staging: Path, target: Path, carry_over: Callable[[str], bool] = _never) -> None:
    """Make the complete folder `staging` the folder at `target`.

    Without an existing `target`, one rename. Otherwise `target` is renamed aside (into a `.NAME.previous-*` folder),
    `staging` is renamed into place, the entries of the old folder for which `carry_over(name)` is true are moved into
    the new one (checkpoints of a training run, say), and the old folder is deleted. If the process dies on the way,
    `target` holds the old folder or the new one, whole, and `recover_interrupted` finishes the job (or undoes it).
    """
    if not target.exists() and not target.is_symlink():
        os.replace(staging, target)
        return
    previous = staging_folder(target, "previous")
    os.replace(target, previous / target.name)
    try:
        os.replace(staging, target)
    except OSError:
        os.replace(previous / target.name, target)  # put the old folder back
        previous.rmdir()
        raise
    _carry_over(previous / target.name, target, carry_over)
    shutil.rmtree(previous)


def _carry_over(old: Path, new: Path, carry_over: Callable[[str], bool]) -> None:
    if not old.is_dir():
        return
    for entry in old.iterdir():
        if carry_over(entry.name) and not (new / entry.name).exists():
            os.replace(entry, new / entry.name)


def _process_is_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return True
    return True


def recover_interrupted(target: Path, carry_over: Callable[[str], bool] = _never) -> list[str]:
    """Deal with what a killed write of `target` left beside it, and say what was done (one line each).

    * `.NAME.previous-*` holds the old folder, set aside by `replace_folder`. Without a folder at `target` (the kill
      came between the two renames) the old folder is put back; with one (the new folder was in place), the old
      folder's entries for which `carry_over(name)` is true are moved over as `replace_folder` would have, and the
      rest is deleted.
    * `.NAME.converting-*` / `.NAME.saving-*` hold a new folder that never reached `target`: deleted.

    Leftovers of a process that is still running are left alone (and named).
    """
    if not target.parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.({'|'.join(LEFTOVER_KINDS)})-(?:(\d+)-)?[^/]*$")
    leftovers = []
    for path in target.parent.iterdir():
        match = pattern.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            pid = int(match.group(2)) if match.group(2) else None  # no pid: a name of an earlier version
            leftovers.append((match.group(1) != "previous", path, pid))
    notes = []
    for _, path, pid in sorted(leftovers):  # folders set aside first: they may have to be put back
        if pid is not None and _process_is_running(pid):
            notes.append(f"left {path} alone: process {pid}, which is writing it, is still running")
            continue
        old = path / target.name
        if path.name.startswith(f".{target.name}.previous-") and old.exists():
            if not target.exists():
                os.replace(old, target)
                notes.append(f"put back {target} from {path}, where an interrupted save had set it aside")
            else:
                _carry_over(old, target, carry_over)
                notes.append(f"deleted {path}, the previous {target.name} an interrupted save had replaced")
        else:
            notes.append(f"deleted {path}, left half-written by an interrupted run")
        shutil.rmtree(path)
    return notes
