"""What the folder writers (folders.py) and their recovery (recovery.py) share: the temporary entries they make,
named `.NAME.KIND-PID-RANDOM` (KIND in `LEFTOVER_KINDS`) to say what they are and which process made them; the files a
saved model is made of; paths with their links resolved and mount points; and the check that an output is apart from
what a run reads. Loads alone, without torch or Transformers.
"""

import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


# `ready`: a new folder inside a mount point whose old entries have all been set aside (into `previous`).
# `retired`: entries a run moved out of its way for good (`set_aside`): never put back, deleted by a completed save.
LEFTOVER_KINDS = ("converting", "saving", "previous", "ready", "retired")


def never(name: str) -> bool:
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


# ---- temporary entries ----------------------------------------------------------------------------------------------


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


def is_own_entry(name: str, target: Path) -> bool:
    """An entry this module made inside `target` (a lock file, a temporary folder): never part of its contents."""
    return name.startswith(f".{target.name}.")


def contents(folder: str | os.PathLike) -> list[str]:
    """The names of the entries of `folder` (links resolved), sorted, without this module's own (a lock file or a
    temporary folder inside a mount point); [] without a folder."""
    folder = resolved(folder)
    if not folder.is_dir():
        return []
    return sorted(name for name in os.listdir(folder) if not is_own_entry(name, folder))


def move_entries(source: Path, destination: Path, replace: bool = True) -> None:
    """Move every entry of `source` into `destination`; with `replace=False`, not over an entry it already has."""
    from .safe_writes import move_entry  # here: loading this module alone stays cheap (and torch-free)

    for entry in sorted(os.listdir(source)):
        if replace or not os.path.lexists(destination / entry):
            move_entry(source / entry, destination / entry)


def carry_over_entries(old: Path, new: Path, carry_over: Callable[[str], bool]) -> None:
    if not old.is_dir():
        return
    for entry in old.iterdir():
        if carry_over(entry.name) and not (new / entry.name).exists():
            os.replace(entry, new / entry.name)
