"""Write an output folder so that nothing is lost: not the old folder, not the new one, not what the run reads.

Every script, the converter and the exporter write through this module:

* `check_not_inputs` refuses an output that is, contains or lies inside something the run reads (paths compared with
  their links resolved), before any work.
* `lock_folder` takes an exclusive lock on the output for the whole run: a second run into the same folder is
  refused at once, naming the process that holds it. The lock is a `flock` on `.NAME.lock` beside the folder (inside
  it when the folder is a mount point), which holds the holder's pid, host and command; the system releases it when
  the holder dies, so a stale lock file is simply taken over.
* `write_folder` writes the new folder under a temporary name and only then replaces the old one; nothing is deleted
  before the new content is complete. Links are resolved first, so the folder a link points to is written, not the
  link. Usually the temporary folder sits beside the target and replaces it with renames (atomic within one file
  system); an existing folder is renamed aside and deleted once the new one is in place. A folder that cannot be
  renamed (a mount point: a Docker or Kubernetes volume, a tmpfs, a bind mount) keeps its place and has its *contents*
  replaced, from a temporary folder inside it, so every rename stays on its file system. Entries of the old folder
  that the writer does not write (a user's notes, checkpoints) stay when its `carry_over` says so:
  `keeps_user_files` keeps all but a saved model's files.
* `write_file` does the same for a file (an ONNX graph and its external data): refused unless it is a file of its
  kind (its suffix, and what an existing file holds), written beside it and moved into place.
* `ran_hf.safe_writes.write_into` (a flat module, because saved folders ship it) is the writer of the library's
  own saves into a folder that keeps its other entries (`save_pretrained` of a model or config, the model's code,
  sentence-transformers' files): written into a temporary folder inside it, then each entry renamed into place, so a
  name that links elsewhere is replaced, never written through. In a folder the writers here are making (a
  `write_folder` staging) the same happens, so every file the package writes goes through one of them.
* A write stopped by the file-size limit (`ulimit -f`), a full disk or a quota raises a
  `ran_hf.safe_writes.WriteStoppedError` naming the output, the file and the cause, the output left as it was.
  (`ran_hf.safe_writes` is imported where needed: this module loads alone, without torch or Transformers.)
* `set_aside` moves entries out of a folder's way for a run that replaces them (the old run's checkpoints under
  `--overwrite_output_dir`); `retire_set_aside` marks the point from which they never come back (the new run writes
  its own), and `discard_set_aside` deletes them once the new run's output is complete.

Temporary names say what they are and which process made them, `.NAME.KIND-PID-RANDOM` (KIND in `LEFTOVER_KINDS`), so
that the next run cleans up after a killed one (`recover_interrupted`): it puts back what was set aside when the new
content never arrived, finishes a replacement whose new content was complete, and deletes half-written folders.
What a run retired (`.NAME.retired-*`) is never put back: it waits, named in the log, for the next completed save.
Folders of a process that is still running are left alone.
"""

import atexit
import errno
import functools
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs are not guarded against each other there
    fcntl = None

logger = logging.getLogger(__name__)

__all__ = [
    "LEFTOVER_KINDS",
    "MODEL_FILES",
    "FolderInUseError",
    "check_file_output",
    "check_not_inputs",
    "contents",
    "discard_set_aside",
    "is_model_file",
    "is_mount_point",
    "keeps_user_files",
    "lock_folder",
    "normal_permissions",
    "recover_interrupted",
    "releases_folder_locks",
    "restore_set_aside",
    "replace_folder",
    "resolved",
    "retire_set_aside",
    "set_aside",
    "staging_folder",
    "write_file",
    "write_folder",
]

# `ready`: a new folder inside a mount point whose old entries have all been set aside (into `previous`).
# `retired`: entries a run moved out of its way for good (`set_aside`): never put back, deleted by a completed save.
LEFTOVER_KINDS = ("converting", "saving", "previous", "ready", "retired")
# A rename that cannot move the folder itself: a mount point (EBUSY), or a target on another file system (EXDEV).
UNMOVABLE = (errno.EBUSY, errno.EXDEV)


def _never(name: str) -> bool:
    return False


# What `save_pretrained` of a model or tokenizer (weights, config, tokenizer files, the model's code, its card) and
# `ran_hf.integrations.sentence_embeddings` write at the top of a folder: a new save replaces all of them, so that a folder never
# shows one model's weights with another's tokenizer or settings. Anything else there is the user's.
MODEL_FILES = frozenset(
    {
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "adapter_model.safetensors",
        "adapter_model.bin",
        "adapter_config.json",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.txt",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
        "README.md",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "1_Pooling",
    }
)
# The model's code, which `save_pretrained` copies beside the weights for remote code: any flat module of the package
# (`ran_hf/`, the parent of this subpackage, which no saved folder carries).
MODEL_FILES = MODEL_FILES | {path.name for path in Path(__file__).parent.parent.glob("*.py")}
WEIGHT_SHARD = re.compile(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")


def is_model_file(name: str) -> bool:
    """Whether `name`, an entry at the top of a folder, is one that saving a model or tokenizer writes."""
    return name in MODEL_FILES or bool(WEIGHT_SHARD.match(name))


def keeps_user_files(name: str) -> bool:
    """A `carry_over` for `write_folder` that saves a model: the old folder's entries that are not a saved model's
    files (a user's notes, plots, checkpoints) stay; its model files go, whether or not the new save writes them."""
    return not is_model_file(name)


def resolved(path: str | os.PathLike) -> Path:
    """`path` absolute, with every link resolved: the place that is really written or read."""
    return Path(os.path.realpath(path))


def is_mount_point(folder: Path) -> bool:
    """Whether `folder` is a mount point, bind mounts on the same file system included (which `os.path.ismount`
    misses); a rename of such a folder fails with EBUSY."""
    if not folder.is_dir():
        return False
    if os.path.ismount(folder):
        return True
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            # field 5 is the mount point, with spaces and the like escaped as octal
            points = {line.split()[4].encode().decode("unicode_escape") for line in mounts if line.strip()}
    except OSError:
        return False
    return str(resolved(folder)) in points


# ---- inputs --------------------------------------------------------------------------------------------------------


def check_not_inputs(
    output: str | os.PathLike, output_flag: str, inputs: Iterable[tuple[str, str | os.PathLike | None]]
) -> None:
    """Refuse an `output` that is one of `inputs` (pairs of the flag or role that names it and a path), lies inside
    an input folder, or contains an input: writing it would overwrite, mix with or delete what the run reads.

    Paths are compared with their links resolved. Inputs that are not local paths (a Hub model id, None) are skipped.
    """
    out = resolved(output)
    for flag, path in inputs:
        if path is None or not os.path.exists(path):
            continue
        read = resolved(path)
        if out == read:
            relation = f"is {flag} {path}"
        elif read.is_dir() and read in out.parents:
            relation = f"lies inside {flag} {path}"
        elif out in read.parents:
            relation = f"holds {flag} {path}"
        else:
            continue
        raise ValueError(
            f"{output_flag} {output} {relation}, which this run reads: writing there would overwrite or delete it. "
            f"Choose an {output_flag} that is apart from what the run reads."
        )


# ---- locks ---------------------------------------------------------------------------------------------------------


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
            for target in list(_SET_ASIDE):
                restore_set_aside(target)
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


# ---- writing -------------------------------------------------------------------------------------------------------


def staging_folder(target: Path, kind: str) -> Path:
    """A new, empty folder `.NAME.KIND-PID-RANDOM` on the file system of `target` (links resolved): beside it, or
    inside it when it is a mount point."""
    if kind not in LEFTOVER_KINDS:
        raise ValueError(f"kind must be one of {LEFTOVER_KINDS}, got {kind!r}")
    target = resolved(target)
    prefix = f".{target.name}.{kind}-{os.getpid()}-"
    if not is_mount_point(target):
        try:
            return Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        except PermissionError:  # a folder whose parent is not ours to write: its contents are replaced
            if not target.is_dir():
                raise
    return Path(tempfile.mkdtemp(prefix=prefix, dir=target))


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
    _carry_over(previous / target.name, target, carry_over)
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


def _own(name: str, target: Path) -> bool:
    """An entry this module made inside `target` (a lock file, a temporary folder): never part of its contents."""
    return name.startswith(f".{target.name}.")


def contents(folder: str | os.PathLike) -> list[str]:
    """The names of the entries of `folder` (links resolved), sorted, without this module's own (a lock file or a
    temporary folder inside a mount point); [] without a folder."""
    folder = resolved(folder)
    if not folder.is_dir():
        return []
    return sorted(name for name in os.listdir(folder) if not _own(name, folder))


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
            if not _own(entry, target) and (entry in new_names or not carry_over(entry)):
                os.replace(target / entry, previous / entry)
        ready = staging.with_name(f".{target.name}.ready-{_kind_of(staging, target)[1]}")
        os.replace(staging, ready)
    except BaseException:
        _move_entries(previous, target)
        previous.rmdir()
        raise
    _move_entries(ready, target)
    ready.rmdir()
    shutil.rmtree(previous)


def _move_entries(source: Path, destination: Path, replace: bool = True) -> None:
    """Move every entry of `source` into `destination`; with `replace=False`, not over an entry it already has."""
    from ..safe_writes import move_entry  # here: loading this module alone stays cheap (and torch-free)

    for entry in sorted(os.listdir(source)):
        if replace or not os.path.lexists(destination / entry):
            move_entry(source / entry, destination / entry)


def _carry_over(old: Path, new: Path, carry_over: Callable[[str], bool]) -> None:
    if not old.is_dir():
        return
    for entry in old.iterdir():
        if carry_over(entry.name) and not (new / entry.name).exists():
            os.replace(entry, new / entry.name)


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
def write_folder(target: str | os.PathLike, kind: str, carry_over: Callable[[str], bool] = _never) -> Iterator[Path]:
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
            from ..safe_writes import stopped_write

            stopped = stopped_write(error, target, staging)
            shutil.rmtree(staging, ignore_errors=True)
            if stopped is not None:
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
            from ..safe_writes import stopped_write

            stopped = stopped_write(error, path.parent, staging)
            if stopped is not None:
                raise stopped from error
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        lock.release()


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


# ---- recovery ------------------------------------------------------------------------------------------------------


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


def recover_interrupted(target: str | os.PathLike, carry_over: Callable[[str], bool] = _never) -> list[str]:
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
                _carry_over(old, target, carry_over)
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
        _move_entries(path, target)
        notes.append(f"moved the new entries of {path} into {target}, as an interrupted save would have")
    for kind, path, _ in inside:
        if kind == "previous" and not ready:
            _move_entries(path, target, replace=False)
            notes.append(f"put back the entries of {target} that an interrupted save had set aside in {path}")
        elif kind == "previous":
            notes.append(f"deleted {path}, the previous entries of {target} an interrupted save had replaced")
        elif kind != "ready":
            notes.append(f"deleted {path}, left half-written by an interrupted run")
        shutil.rmtree(path)
    return notes
