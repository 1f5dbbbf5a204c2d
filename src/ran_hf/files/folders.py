"""Write an output folder so that nothing is lost: not the old folder, not the new one, not what the run reads.

Every script, the converter and the exporter write through this module:

* `write_folder` writes the new folder under a temporary name and only then replaces the old one; nothing is deleted
  before the new content is complete. Links are resolved first, so the folder a link points to is written, not the
  link. Usually the temporary folder sits beside the target and replaces it with renames (atomic within one file
  system); an existing folder is renamed aside and deleted once the new one is in place. A folder that cannot be
  renamed (a mount point: a Docker or Kubernetes volume, a tmpfs, a bind mount) keeps its place and has its *contents*
  replaced, from a temporary folder inside it, so every rename stays on its file system. Entries of the old folder
  that the writer does not write (a user's notes, checkpoints) stay when its `carry_over` says so:
  `keeps_user_files` (paths.py) keeps all but a saved model's files.
* `write_file` does the same for a file (an ONNX graph and its external data): refused unless it is a file of its
  kind (its suffix, and what an existing file holds), written beside it and moved into place.
* Both lock the output meanwhile (folder_locks.py) and first clean up what a killed write left (recovery.py).
* `safe_writes.write_into` (which saved folders ship, flat) is the writer of the library's
  own saves into a folder that keeps its other entries (`save_pretrained` of a model or config, the model's code,
  sentence-transformers' files): written into a temporary folder inside it, then each entry renamed into place, so a
  name that links elsewhere is replaced, never written through. In a folder the writers here are making (a
  `write_folder` staging) the same happens, so every file the package writes goes through one of them.
* A write stopped by the file-size limit (`ulimit -f`), a full disk or a quota raises a
  `safe_writes.WriteStoppedError` naming the output, the file and the cause, the output left as it was.
  (`safe_writes` is imported where needed: this module loads alone, without torch or Transformers.)
"""

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .folder_locks import lock_folder
from .paths import carry_over_entries, is_own_entry, move_entries, never, resolved, staging_folder
from .recovery import recover_interrupted


logger = logging.getLogger(__name__)

# A rename that cannot move the folder itself: a mount point (EBUSY), or a target on another file system (EXDEV).
UNMOVABLE = (errno.EBUSY, errno.EXDEV)


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


def replace_folder(staging: Path, target: Path, carry_over: Callable[[str], bool] = never) -> None:
    """Make the complete folder `staging` (from `staging_folder`) the folder at `target` (links resolved).

    The new folder holds `staging`'s entries and those of the old folder for which `carry_over(name)` is true and
    that `staging` lacks (checkpoints of a training run, say). Beside the target: one rename without an old folder;
    otherwise the old folder is renamed aside (`.NAME.previous-*`), `staging` renamed into place, the carried entries
    moved over and the old folder deleted. Inside the target (a mount point), or when the target turns out not to
    move (EBUSY, EXDEV): its contents are replaced instead (`_replace_contents`). If the process dies on the way,
    `recover_interrupted` finishes the job (or undoes it).
    """
    target = resolved(target)
    if staging.parent == target:
        _replace_contents(staging, target, carry_over)
        return
    if not target.exists():
        os.replace(staging, target)
        return
    previous = staging_folder(target, "previous")
    try:
        os.replace(target, previous / target.name)
    except OSError as error:
        previous.rmdir()
        if error.errno not in UNMOVABLE:
            raise
        _replace_contents(_move_inside(staging, target), target, carry_over)
        return
    try:
        os.replace(staging, target)
    except OSError:
        os.replace(previous / target.name, target)  # put the old folder back
        previous.rmdir()
        raise
    carry_over_entries(previous / target.name, target, carry_over)
    shutil.rmtree(previous)


def _move_inside(staging: Path, target: Path) -> Path:
    """Move `staging` into `target`, by a rename, or by a copy when `target` is on another file system."""
    kind, _ = _kind_of(staging, target)
    inside = Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-{os.getpid()}-", dir=target))
    try:
        os.replace(staging, inside)
    except OSError as error:
        if error.errno != errno.EXDEV:
            inside.rmdir()
            raise
        shutil.copytree(staging, inside, dirs_exist_ok=True)
        shutil.rmtree(staging)
    return inside


def _kind_of(staging: Path, target: Path) -> tuple[str, str]:
    """(KIND, PID-RANDOM) of a temporary folder `.NAME.KIND-PID-RANDOM` of `target`."""
    kind, _, rest = staging.name[len(target.name) + 2 :].partition("-")
    return kind, rest


def _replace_contents(staging: Path, target: Path, carry_over: Callable[[str], bool]) -> None:
    """Replace the contents of `target` with those of `staging`, a complete folder inside it.

    The old entries that go (those `staging` replaces, and those not carried over) are moved into a
    `.NAME.previous-*` folder inside `target`; only when all are there is `staging` renamed `.NAME.ready-*` (the mark
    that the rest can be finished), its entries moved in, and the old ones deleted. A failure before the mark puts
    the old entries back.
    """
    new_names = set(os.listdir(staging))
    previous = staging_folder(target, "previous")
    try:
        for entry in sorted(os.listdir(target)):
            if not is_own_entry(entry, target) and (entry in new_names or not carry_over(entry)):
                os.replace(target / entry, previous / entry)
        ready = staging.with_name(f".{target.name}.ready-{_kind_of(staging, target)[1]}")
        os.replace(staging, ready)
    except BaseException:
        move_entries(previous, target)
        previous.rmdir()
        raise
    move_entries(ready, target)
    ready.rmdir()
    shutil.rmtree(previous)


def check_folder_output(target: str | os.PathLike) -> None:
    """Refuse a folder output `target` that is a file, or a link to one: writing the folder would replace it."""
    path = resolved(target)
    if os.path.lexists(path) and not path.is_dir():
        shown = f"{target} (a link to {path})" if os.path.islink(target) else f"{target}"
        raise ValueError(
            f"{shown} is a file, not a folder: writing the output folder there would replace the file. Choose a "
            "folder (a new one, or one that holds an earlier output of the same kind)."
        )


@contextmanager
def write_folder(target: str | os.PathLike, kind: str, carry_over: Callable[[str], bool] = never) -> Iterator[Path]:
    """Write the folder `target` (links resolved) through a temporary folder: `with write_folder(target, "saving") as
    staging: model.save_pretrained(staging)`.

    The output is locked for the duration (`lock_folder`; a script holds it from its start). When the block ends
    normally, the new folder, with normal permissions, replaces `target` (`replace_folder`; entries of the old folder
    for which `carry_over(name)` is true stay); when it raises, or writes nothing, `target` is left as it was. Should
    the replacement itself fail, the new folder is kept under a visible name, which the error gives. A `target` that
    is a file (links resolved) is refused with a `ValueError` before anything is written: the folder would replace it.
    """
    check_folder_output(target)
    target = resolved(target)
    lock = lock_folder(target)
    try:
        for note in recover_interrupted(target, carry_over):
            logger.warning(f"Before writing {target}: {note}.")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_folder(target, kind)
        try:
            yield staging
        except BaseException as error:
            from .safe_writes import discard_staging

            if (stopped := discard_staging(error, target, staging)) is not None:
                raise stopped from error
            raise
        if not any(staging.iterdir()):
            staging.rmdir()
            return
        normal_permissions(staging)
        working_in_target = target.is_dir() and os.path.samefile(os.getcwd(), target)
        try:
            replace_folder(staging, target, carry_over)
        except OSError as error:
            kept = _keep_visible(staging, target)
            where = f"the new content is complete in {kept}" if kept else "the new content was not kept"
            raise OSError(error.errno, f"Could not put the new {target.name} in place at {target} ({error}); {where}")
        except BaseException:  # interrupted: the old folder is in place or set aside for recover_interrupted
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if working_in_target:  # the old folder, our working directory, was renamed away: move into the new one
            os.chdir(target)
    finally:
        lock.release()


def _keep_visible(staging: Path, target: Path) -> Path | None:
    """After a failed replacement: the complete new folder, renamed so that no later run deletes it as a leftover.
    (A `.NAME.ready-*` folder is left for `recover_interrupted`, which moves it in.)"""
    if not staging.is_dir():
        return None
    kept = Path(tempfile.mkdtemp(prefix=f"{target.name}.new-", dir=staging.parent))
    os.replace(staging, kept)
    return kept


def check_file_output(
    target: str | os.PathLike, flag: str, suffix: str, is_ours: Callable[[Path], bool], what: str
) -> None:
    """Refuse a file output `target` that would replace something other than a file of its kind: a name (as given,
    or its link's target) without `suffix`, a folder, or an existing non-empty file that `is_ours` does not
    recognize as `what` (model weights, a config, anything else), or a path inside a file."""
    path = resolved(target)
    for name, shown in ((Path(target).name, ""), (path.name, f": it links to {path}")):
        if not name.endswith(suffix):
            raise ValueError(
                f"{flag} {target} is not a {suffix} file{shown}; writing {what} there would replace what it holds. "
                f"Name a {suffix} file."
            )
    if path.is_dir():
        raise ValueError(f"{flag} {target} is a folder; name the {suffix} file to write.")
    holder = next((parent for parent in path.parents if parent.exists()), None)  # the folder it would be made in
    if holder is not None and not holder.is_dir():
        raise ValueError(
            f"{flag} {target} cannot be written: {holder} is a file, not a folder. Name a path in a folder."
        )
    if path.is_file() and path.stat().st_size and not is_ours(path):
        raise ValueError(
            f"{flag} {target} already exists and is not {what}: writing there would replace it. Move it away, or "
            "choose another path."
        )


@contextmanager
def write_file(
    target: str | os.PathLike,
    flag: str = "path",
    suffix: str = "",
    is_ours: Callable[[Path], bool] = lambda path: True,
    what: str = "the new file",
) -> Iterator[Path]:
    """Write the file `target` (links resolved), and the files that go with it (named `target`'s name and more: an
    ONNX graph's external data), through a temporary folder beside it: `with write_file(path, "--output", ".onnx",
    ...) as staged: program.save(staged)`, where `staged` is the file to write, in that folder.

    `target` is checked first (`check_file_output`), locked meanwhile (`lock_folder`), and what a killed write left
    beside it is cleaned up. When the block ends normally, the files written are moved into place, `target` last: a
    killed write never leaves a half-written file, nor a file without its companions. When it raises, nothing is
    replaced.
    """
    check_file_output(target, flag, suffix, is_ours, what)
    path = resolved(target)
    lock = lock_folder(path)
    try:
        for note in recover_interrupted(path):
            logger.warning(f"Before writing {path}: {note}.")
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_folder(path, "saving")
        try:
            yield staging / path.name
            written = sorted(staging.iterdir(), key=lambda file: file.name == path.name)
            strays = [file.name for file in written if not file.name.startswith(path.name) or file.is_dir()]
            if strays:
                raise ValueError(f"Writing {path} made {strays}, which are not files named after it: not moved")
            normal_permissions(staging)
            for file in written:
                os.replace(file, path.parent / file.name)
        except BaseException as error:
            from .safe_writes import stopped_write

            stopped = stopped_write(error, path.parent, staging)
            if stopped is not None:
                raise stopped from error
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        lock.release()
