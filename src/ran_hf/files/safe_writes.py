"""`write_into`: the guarded writer of every file `ran_hf` saves into a folder that may already hold files (a model's
or a config's `save_pretrained`, the model's code, sentence-transformers' files). The scripts' folders go through
`ran_hf.files.folders.write_folder`, which names a write stopped by a limit with `stopped_write`, as this does.

Transformers opens each file of a save by its name. A name in the folder that is a symbolic link is written through,
so the file it points to, outside the folder (a Hub cache's blob, another model's config), is overwritten; and a
save stopped halfway (a full disk, the file-size limit, an exception, a kill) leaves a half-written file where a good
one was. Here a save is written into a new temporary folder inside the target, and only a complete one is moved in,
one rename per entry: a rename replaces a link itself, never what it points to (the link's file is left unchanged,
and a warning names it), and it replaces a file whole.

Saved folders ship this module (the config imports it), so it imports the standard library and Transformers only.
"""

import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers.utils import logging


try:
    import resource
except ImportError:  # Windows: no file-size limit to name
    resource = None

logger = logging.get_logger(__name__)

# The temporary folders inside the target, `.NAME.KIND-PID-RANDOM`, named as `ran_hf.files.folders` names its own so
# that either cleans up after a killed save: `saving` is half-written (deleted), `ready` complete (moved in).
WRITING, COMPLETE = "saving", "ready"
# What stops a write when a limit is reached, and what to say of it.
LIMITS = {errno.EFBIG: "the file-size limit", errno.ENOSPC: "a full disk", getattr(errno, "EDQUOT", -1): "a quota"}
# A weights shard of Transformers' naming, `model-00001-of-00003.safetensors`: (its prefix, the rest).
WEIGHT_SHARD = re.compile(r"^(.*?)-\d{5}-of-\d{5}(\.safetensors|\.bin)$")
WEIGHT_FILE = re.compile(r"^(.*?)(\.safetensors|\.bin)$")
INDEX_SUFFIX = ".index.json"


class WriteStoppedError(OSError):
    """A save that the file-size limit, a full disk or a quota stopped; the folder saved into is left as it was.
    `path` is the file being written when known (safetensors deletes a file it could not finish)."""

    def __init__(self, code: int, message: str, path: Path | None):
        super().__init__(code, message)
        self.path = path


def _file_size_limit() -> int | None:
    if resource is None:
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def stopped_write(error: BaseException, folder: Path, staging: Path) -> WriteStoppedError | None:
    """For an `error` that stopped writing `staging`, the temporary folder of a save into `folder`, because a limit
    was reached: an error naming the file, `folder`, the cause and the fix; None for any other error. (safetensors'
    own, `Error while serializing: I/O error: File too large (os error 27)`, names neither the file nor the limit.)"""
    if isinstance(error, OSError):
        code, path = error.errno, getattr(error, "path", None) or error.filename
    else:
        found = re.search(r"\(os error (\d+)\)", str(error))
        code, path = (int(found.group(1)) if found else None), None
    if code not in LIMITS:
        return None
    limit = _file_size_limit()
    if path is not None and staging in Path(path).parents:  # named where it was to go
        path = folder / Path(path).relative_to(staging)
    elif path is not None and folder not in Path(path).parents:
        path = None  # a file read (the source of a copy), not the one written
    if path is None and code == errno.EFBIG and limit is not None:  # the file the limit cut short
        path = next((file for file in staging.rglob("*") if file.is_file() and file.stat().st_size >= limit), None)
        path = path and folder / path.relative_to(staging)
    while isinstance(error, WriteStoppedError) and error.__cause__ is not None:  # a nested save's, named again
        error = error.__cause__
    what = path or ("a weights file (.safetensors)" if type(error).__name__ == "SafetensorError" else "a file")
    if code == errno.EFBIG:
        cause = (
            f"this process may not write a file over {limit:,} bytes (its file-size limit, `ulimit -f`)"
            if limit is not None
            else "the file system or the process's file-size limit does not allow a file this large"
        )
        fix = (
            "Raise the limit (`ulimit -f unlimited` in the shell that starts Python), or save the weights in shards "
            "below it (`save_pretrained(..., max_shard_size=...)`)."
        )
    else:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        cause = f"{LIMITS[code]} ({free:,} bytes free there)"
        fix = (
            "The save needs room for its files beside the old ones until it completes: free space, or save into "
            "another folder."
        )
    return WriteStoppedError(
        code,
        f"Saving into {folder} stopped while writing {what}: {os.strerror(code)}: {cause}. {folder} is left as it "
        f"was. {fix}",
        path,
    )


def discard_staging(error: BaseException, folder: Path, staging: Path) -> WriteStoppedError | None:
    """`staging` removed after `error` stopped a write into it: what to raise instead of `error` (`stopped_write`),
    None to raise `error` itself."""
    stopped = stopped_write(error, folder, staging)
    shutil.rmtree(staging, ignore_errors=True)
    return stopped


def superseded_weights(written: set[str], existing: Iterable[str]) -> set[str]:
    """The weight files of an earlier save that a save writing `written` leaves behind, which loading would read
    instead of (or beside) the new ones: shards named with the prefix of a weights file written (`model-00002-of-00002`
    after a save in one file, as Transformers' own save deletes them), a single file and its shards' index where the
    new save is the other kind (`model.safetensors` after a sharded save; `model.safetensors.index.json` after a save
    in one file)."""
    shard_prefixes, file_prefixes = set(), set()
    for name in written:
        if found := WEIGHT_SHARD.match(name):
            shard_prefixes.add(found.group(1))
        elif found := WEIGHT_FILE.match(name):
            file_prefixes.add(found.group(1))

    def stale(name: str) -> bool:
        if name in written:
            return False
        if WEIGHT_SHARD.match(name):
            return any(name.startswith(prefix) for prefix in shard_prefixes | file_prefixes)
        if name.endswith(INDEX_SUFFIX):  # the index of shards the new save, in one file, no longer has
            indexed = WEIGHT_FILE.match(name.removesuffix(INDEX_SUFFIX))
            return indexed is not None and indexed.group(1) in file_prefixes
        single = WEIGHT_FILE.match(name)
        return single is not None and single.group(1) in shard_prefixes  # one file, where the new save has shards

    return {name for name in existing if stale(name)}


def hub_repo(save_directory: str | os.PathLike, push_to_hub: bool, kwargs: dict) -> dict:
    """The `kwargs` of a `save_pretrained(push_to_hub=True)` made into a temporary folder, with the Hub repository
    named after `save_directory` as Transformers names it, not after the temporary folder."""
    if push_to_hub and "repo_id" not in kwargs:
        return {**kwargs, "repo_id": os.fspath(save_directory).split(os.path.sep)[-1]}
    return kwargs


def move_entry(entry: Path, destination: Path) -> str | None:
    """Rename `entry` to `destination`, replacing what is there; returns where `destination` linked to if it was a
    link. A link is replaced itself, never followed; a folder is replaced whole; a file replaced keeps its mode."""
    link = os.readlink(destination) if os.path.islink(destination) else None
    if link is None and destination.is_file() and entry.is_file():
        os.chmod(entry, stat.S_IMODE(destination.stat().st_mode))
    if entry.is_dir() and not entry.is_symlink() and os.path.lexists(destination):  # a rename cannot replace these
        if link is not None or not destination.is_dir():
            destination.unlink()
        else:
            shutil.rmtree(destination)
    os.replace(entry, destination)
    return link


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()  # a link itself, never what it points to


def _normal_permissions(folder: Path) -> None:
    """What a plain `mkdir` / `open` would give (0777 / 0666 less the umask): `mkdtemp` makes its folder 0700."""
    umask = os.umask(0)
    os.umask(umask)
    for root, folders, _ in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
    os.chmod(folder, 0o777 & ~umask)


def _is_running(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # os.kill(pid, 0) would end the process there: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _finish_interrupted(target: Path) -> None:
    """What a killed save into `target` left: a complete save (`ready`) is moved in, a half-written one deleted.
    Those of a process still running are left alone."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.({WRITING}|{COMPLETE})-(\d+)-[^/]*$")
    for place in (target, target.parent):
        for name in sorted(os.listdir(place)) if place.is_dir() else ():
            found = pattern.match(name)
            path = place / name
            if not found or not path.is_dir() or path.is_symlink() or _is_running(int(found.group(2))):
                continue
            if found.group(1) == COMPLETE and place == target:
                for entry in sorted(os.listdir(path)):
                    move_entry(path / entry, target / entry)
                logger.warning(f"{target}: moved in what an interrupted save had completed in {path}.")
            else:
                logger.warning(f"{target}: deleted {path}, left half-written by an interrupted save.")
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def write_into(
    folder: str | os.PathLike, superseded: Callable[[set[str]], Iterable[str]] = lambda written: ()
) -> Iterator[Path]:
    """Save into `folder` (a link to a folder is followed; made if missing) through a temporary folder: `with
    write_into(folder) as staging: write(staging)`. Entries of `folder` the save does not write stay.

    When the block ends normally, each entry written replaces the entry of its name in `folder` by a rename
    (`move_entry`): a link there is replaced, never written through, and a warning names it. Then the weight shards
    of an earlier save that this one supersedes (`superseded_weights`) and the entries `superseded(written names)`
    names go. When the block raises, `folder` is left as it was; a write that the file-size limit, a full disk or a
    quota stopped raises a `WriteStoppedError` naming `folder`, the file and the cause (`stopped_write`).

    A kill while writing leaves a temporary folder that the next save deletes; once the save is complete, the folder
    is marked so (`.NAME.ready-*`), and a kill among the renames is finished by the next save (or script run).
    """
    target = Path(os.path.realpath(folder))
    if os.path.lexists(target) and not target.is_dir():
        raise NotADirectoryError(
            f"{folder} is a file: saving writes a folder (config, weights, code) and would replace it. Give the path "
            "of a folder, new or existing."
        )
    inside = target.is_dir()
    place = target if inside else target.parent
    place.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{WRITING}-{os.getpid()}-", dir=place))
    try:
        yield staging
        written = set(os.listdir(staging))
        for name in sorted(written):
            destination, entry = target / name, staging / name
            if inside and not os.path.islink(destination) and os.path.exists(destination):
                if destination.is_dir() != entry.is_dir():
                    kind, other = ("folder", "file") if destination.is_dir() else ("file", "folder")
                    raise FileExistsError(
                        f"{destination} is a {kind}, where the save writes a {other} of that name: nothing was "
                        f"saved. Move it away, or save into another folder."
                    )
    except BaseException as error:
        if (stopped := discard_staging(error, target, staging)) is not None:
            raise stopped from error
        raise
    if not written:  # a rank that does not save, say
        staging.rmdir()
        return
    _normal_permissions(staging)
    _finish_interrupted(target)
    if not inside:
        os.replace(staging, target)  # one rename: the folder appears complete
        return
    ready = staging.with_name(staging.name.replace(f".{WRITING}-", f".{COMPLETE}-", 1))
    os.replace(staging, ready)
    links = {}
    # The config last: a folder shows a config only with the files it names.
    for name in sorted(written, key=lambda name: (name == "config.json", name)):
        link = move_entry(ready / name, target / name)
        if link is not None:
            links[name] = link
    ready.rmdir()
    existing = set(os.listdir(target))
    for name in (superseded_weights(written, existing) | set(superseded(written))) & existing - written:
        _remove(target / name)
    if links:
        shown = ", ".join(f"{name} (a link to {link})" for name, link in sorted(links.items()))
        logger.warning(
            f"{target}: replaced {shown} by the file saved; a link is never written through, so what it points to "
            "is unchanged."
        )
