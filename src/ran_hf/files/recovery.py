"""Nothing lost when a run is killed. The next write of the same output cleans up after it (`recover_interrupted`):
it puts back what was set aside when the new content never arrived, finishes a replacement whose new content was
complete, and deletes half-written folders. What a run retired (`.NAME.retired-*`) is never put back: it waits, named
in the log, for the next completed save. Folders of a process that is still running are left alone.

`set_aside` moves entries out of a folder's way for a run that replaces them (the old run's checkpoints under
`--overwrite_output_dir`); `retire_set_aside` marks the point from which they never come back (the new run writes its
own), and `discard_set_aside` deletes them once the new run's output is complete.
"""

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from .paths import LEFTOVER_KINDS, carry_over_entries, move_entries, never, resolved, staging_folder


logger = logging.getLogger(__name__)


# Per folder: the folders `set_aside` made in this process, and whether they are retired (never put back).
_SET_ASIDE: dict[Path, list[Path]] = {}

_RETIRED: set[Path] = set()


def set_aside(target: str | os.PathLike, names: Iterable[str]) -> Path:
    """Move the entries `names` of the folder `target` out of its way (into `.NAME.retired-PID-RANDOM`), without
    deleting them yet: a run that replaces a folder's old checkpoints deletes them with `discard_set_aside` once its
    own output is complete. Until `retire_set_aside`, a run that fails puts them back (`restore_set_aside`); after a
    kill they are never put back (`recover_interrupted` leaves them, naming them): a later `latest` must resume the
    run that replaced them, never them. Returns the folder they are in."""
    target = resolved(target)
    retired = staging_folder(target, "retired")
    into = retired if retired.parent == target else retired / target.name
    into.mkdir(exist_ok=True)
    for name in names:
        os.replace(target / name, into / name)
    _SET_ASIDE.setdefault(target, []).append(retired)
    return retired


def retire_set_aside(target: str | os.PathLike) -> None:
    """From now on, what `set_aside` moved out of `target`'s way in this process is not put back even if the run
    fails: call it before the run writes an entry of its own (its first checkpoint) beside which they would mix."""
    target = resolved(target)
    if _SET_ASIDE.get(target):
        _RETIRED.add(target)


def _set_aside_entries(folder: Path, target: Path) -> tuple[Path, list[str]]:
    into = folder if folder.parent == target else folder / target.name
    return into, sorted(os.listdir(into)) if into.is_dir() else []


def restore_set_aside(target: str | os.PathLike) -> None:
    """Put back what `set_aside` moved out of `target`'s way in this process, for a run that failed before
    `retire_set_aside` (before it wrote anything of its own): entries the run wrote under the same names since are
    kept, and the old ones stay where they were set aside. Once retired, they stay set aside (the log says where)
    until a later run's completed save deletes them."""
    target = resolved(target)
    retired = target in _RETIRED
    _RETIRED.discard(target)
    for folder in _SET_ASIDE.pop(target, []):
        into, names = _set_aside_entries(folder, target)
        if retired:
            if names:
                logger.warning(
                    f"{target}: kept {', '.join(names)} of the run this one replaced in {folder}, not put back beside "
                    f"this run's own; deleted once a run into {target} saves its model."
                )
            continue
        for name in names:
            if not os.path.lexists(target / name):
                os.replace(into / name, target / name)
        if into.is_dir() and not any(into.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)
        elif names:
            logger.warning(f"{target}: put back what this run had set aside, except {', '.join(os.listdir(into))}.")


def restore_every_set_aside() -> None:
    """`restore_set_aside` for every folder this process set entries aside from (a script that raised)."""
    for target in list(_SET_ASIDE):
        restore_set_aside(target)


def discard_set_aside(target: str | os.PathLike) -> None:
    """Delete what `set_aside` moved out of `target`'s way: in this process, and what runs into `target` that are no
    longer running retired (a killed run's old checkpoints). Call it once the new output is complete."""
    target = resolved(target)
    _RETIRED.discard(target)
    for folder in _SET_ASIDE.pop(target, []):
        shutil.rmtree(folder, ignore_errors=True)
    places = [target.parent, target] if target.is_dir() else [target.parent]
    for place in places:
        if place.is_dir():
            _, leftovers = _not_running(_leftovers(place, target))
            for kind, path, _ in leftovers:
                if kind == "retired":
                    logger.info(f"Deleted {path}: what an earlier run into {target} had retired.")
                    shutil.rmtree(path, ignore_errors=True)


# ---- after a kill ---------------------------------------------------------------------------------------------------


def _process_is_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say
        return True
    return True


def _leftovers(folder: Path, target: Path) -> list[tuple[str, Path, int | None]]:
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.({'|'.join(LEFTOVER_KINDS)})-(?:(\d+)-)?[^/]*$")
    found = []
    for path in folder.iterdir():
        match = pattern.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            pid = int(match.group(2)) if match.group(2) else None  # no pid: a name of an earlier version
            found.append((match.group(1), path, pid))
    return found


def recover_interrupted(target: str | os.PathLike, carry_over: Callable[[str], bool] = never) -> list[str]:
    """Deal with what a killed write of `target` (links resolved) left, and say what was done (one line each).

    Beside `target`:
    * `.NAME.previous-*` holds the old folder, set aside by `replace_folder`. Without a folder at `target` (the kill
      came between the two renames) the old folder is put back; with one (the new folder was in place), the old
      folder's entries for which `carry_over(name)` is true are moved over as `replace_folder` would have, and the
      rest is deleted.
    * `.NAME.converting-*` / `.NAME.saving-*` hold a new folder that never reached `target`: deleted.
    * `.NAME.retired-*` holds what a run retired (`set_aside`): never put back, left alone and named.

    Inside `target` (a mount point, whose contents are replaced):
    * `.NAME.ready-*` holds new entries whose old ones were all set aside: moved in, and the set-aside ones deleted.
    * otherwise `.NAME.previous-*` holds old entries set aside: put back; half-written new folders are deleted.

    Leftovers of a process that is still running are left alone (and named).
    """
    target = resolved(target)
    if not target.parent.is_dir():
        return []
    notes, beside = _not_running(_leftovers(target.parent, target))
    notes += [_retired_note(path, target) for kind, path, _ in beside if kind == "retired"]
    beside = [item for item in beside if item[0] != "retired"]
    for kind, path, _ in sorted(beside, key=lambda item: item[0] != "previous"):  # set-aside folders first
        old = path / target.name
        if kind == "previous" and old.exists():
            if not target.exists():
                os.replace(old, target)
                notes.append(f"put back {target} from {path}, where an interrupted save had set it aside")
            else:
                carry_over_entries(old, target, carry_over)
                notes.append(f"deleted {path}, the previous {target.name} an interrupted save had replaced")
        else:
            notes.append(f"deleted {path}, left half-written by an interrupted run")
        shutil.rmtree(path)
    if target.is_dir():
        notes += _recover_contents(target)
    return notes


def _not_running(leftovers: list) -> tuple[list[str], list]:
    """Notes on the leftovers of running processes (left alone), and the others."""
    notes, others = [], []
    for kind, path, pid in leftovers:
        if pid == os.getpid():
            continue  # this process's own (a folder it set aside, say): not a leftover
        if pid is not None and _process_is_running(pid):
            notes.append(f"left {path} alone: process {pid}, which is writing it, is still running")
        else:
            others.append((kind, path, pid))
    return notes, others


def _retired_note(path: Path, target: Path) -> str:
    _, names = _set_aside_entries(path, target)
    return (
        f"left {path} alone: it holds {', '.join(names) or 'nothing'}, which a run that replaced {target} retired "
        f"(never put back: resuming continues the run that replaced them); deleted once a run into {target} saves its "
        "model"
    )


def _recover_contents(target: Path) -> list[str]:
    notes, inside = _not_running(_leftovers(target, target))
    notes += [_retired_note(path, target) for kind, path, _ in inside if kind == "retired"]
    inside = [item for item in inside if item[0] != "retired"]
    ready = [path for kind, path, _ in inside if kind == "ready"]
    for path in ready:
        move_entries(path, target)
        notes.append(f"moved the new entries of {path} into {target}, as an interrupted save would have")
    for kind, path, _ in inside:
        if kind == "previous" and not ready:
            move_entries(path, target, replace=False)
            notes.append(f"put back the entries of {target} that an interrupted save had set aside in {path}")
        elif kind == "previous":
            notes.append(f"deleted {path}, the previous entries of {target} an interrupted save had replaced")
        elif kind != "ready":
            notes.append(f"deleted {path}, left half-written by an interrupted run")
        shutil.rmtree(path)
    return notes
