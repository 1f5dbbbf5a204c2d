"""The output folder of a training run and its checkpoints: what a run writes there, which checkpoint to resume
from (complete, intact, not diverged, built with this run's settings), and the checks made on `--output_dir` before
any work (`prepare_output_dir`).

Machinery shared by the example training scripts (`scripts/<task>/run_*.py`), which import it with `scripts/` on
`sys.path`; `ran_trainer.RANTrainer` uses the same names when it saves.
"""

import json
import logging
import re
import warnings
import zipfile
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ran_hf.files.folder_locks import lock_folder
from ran_hf.files.paths import MODEL_FILES, check_not_inputs, contents
from ran_hf.files.recovery import recover_interrupted, set_aside


logger = logging.getLogger(__name__)

WEIGHTS_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
RESUME_LATEST = ("latest", "true")
CHECKPOINT_PATTERN = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# What a run writes at the top of its output folder besides checkpoints: a new final save replaces all of it, so that
# the folder never shows one run's model with another run's metrics or card: a saved model's files
# (`ran_hf.files.paths.MODEL_FILES`: weights, adapter, config, tokenizer, the model's code, its card, the
# sentence-transformers files of `--sentence_transformers_pooling`), and what Trainer writes beside them.
RUN_FILES = MODEL_FILES | {"training_args.bin", "trainer_state.json", "predict_results.txt", "predictions.txt"}
# A LoRA run (`--lora_r`) saves the adapter (and the head modules it trains in full), not the model.
ADAPTER_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
WEIGHT_SHARD_PATTERN = re.compile(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")
# Files `Trainer` loads to resume, checked to load before a checkpoint is chosen.
RESUMED_TORCH_FILES = re.compile(
    r"^(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|pytorch_model.*\.bin)$"
)


def is_run_file(name: str) -> bool:
    return name in RUN_FILES or name.endswith("_results.json") or bool(WEIGHT_SHARD_PATTERN.match(name))


def missing_from_checkpoint(folder: str | Path) -> list[str]:
    """What a checkpoint folder lacks to resume from (empty when complete).

    Trainer writes `checkpoint-N/` in place: weights, then optimizer, scheduler and RNG states, and
    `trainer_state.json` last. A run killed while saving leaves a folder without (or with a truncated)
    `trainer_state.json`.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return ["the folder itself"]
    names = {path.name for path in folder.iterdir()}
    missing = []
    try:
        json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        missing.append("a readable trainer_state.json")
    if not names.intersection(WEIGHTS_NAMES + ADAPTER_NAMES) and not any(
        name.startswith(("global_step", "pytorch_model_fsdp")) for name in names
    ):
        missing.append("model weights")
    # DeepSpeed and FSDP keep the optimizer state in their own sub-folders.
    if "optimizer.pt" not in names and not any(name.startswith(("global_step", "optimizer_")) for name in names):
        missing.append("optimizer.pt")
    if "scheduler.pt" not in names:
        missing.append("scheduler.pt")
    if not any(name.startswith("rng_state") for name in names):
        missing.append("rng_state*.pth")
    return missing or damaged_in_checkpoint(folder)


def damaged_in_checkpoint(folder: Path) -> list[str]:
    """The files `Trainer` would load to resume that do not load: truncated or damaged weights (safetensors header
    and size), optimizer, scheduler, scaler or RNG states (`torch.save` archives, their CRC-32s checked)."""
    damaged = []
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
        elif path.name.endswith(".safetensors.index.json"):
            problem = sharded_safetensors_problem(path)
        elif RESUMED_TORCH_FILES.match(path.name):
            problem = torch_file_problem(path)
        else:
            continue
        if problem:
            damaged.append(f"an intact {path.name} ({problem})")
    return damaged


def safetensors_problem(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="pt") as file:
            file.keys()
    except (SafetensorError, OSError) as error:
        return str(error)
    return None


def sharded_safetensors_problem(path: Path) -> str | None:
    try:
        shards = set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"not a readable index: {error}"
    for shard in sorted(shards):
        if not (path.parent / shard).is_file():
            return f"its shard {shard} is missing"
        problem = safetensors_problem(path.parent / shard)
        if problem:
            return f"its shard {shard}: {problem}"
    return None


def torch_file_problem(path: Path) -> str | None:
    """`torch.save` writes a zip archive: a cut file has no central directory, a changed byte fails a CRC-32."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad_member = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f"not a complete torch.save archive: {error}"
    return f"{bad_member} fails its CRC-32 check" if bad_member else None


def checkpoints_in(output_dir: Path) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, newest first."""
    found = [path for path in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if CHECKPOINT_PATTERN.match(path.name)]
    return sorted(found, key=lambda path: int(CHECKPOINT_PATTERN.match(path.name).group(1)), reverse=True)


def checkpoint_to_resume(training_args: transformers.TrainingArguments) -> str | None:
    """The checkpoint `--resume_from_checkpoint` asks for, checked to load before any training happens.

    `PATH` must be a complete, intact checkpoint. `latest` takes the newest complete and intact `checkpoint-N` of
    `--output_dir`, skipping (with a warning naming the file) one that a killed run left half-written or whose files
    are truncated or damaged, and starts from scratch when there is none, so that a restarted job can always pass
    `latest`.
    """
    requested = training_args.resume_from_checkpoint
    if requested is None:
        return None
    if requested.lower() not in RESUME_LATEST:
        missing = missing_from_checkpoint(requested)
        if missing:
            raise ValueError(f"Cannot resume from {requested}: it lacks {', '.join(missing)}.")
        refuse_diverged_checkpoint(requested)
        return requested
    output_dir = Path(training_args.output_dir)
    for checkpoint in checkpoints_in(output_dir):
        missing = missing_from_checkpoint(checkpoint)
        if not missing:
            refuse_diverged_checkpoint(checkpoint)
            logger.warning(f"Resuming from {checkpoint}")
            return str(checkpoint)
        logger.warning(
            f"Skipping {checkpoint}: it lacks {', '.join(missing)}; an interrupted save or a damaged disk left it so."
        )
    logger.warning(f"No complete checkpoint in {output_dir}: training starts from scratch.")
    return None


# Config fields that say how a model was saved or is run, not what it computes.
BOOKKEEPING_CONFIG_FIELDS = frozenset(
    {"transformers_version", "_name_or_path", "architectures", "auto_map", "dtype", "torch_dtype", "use_cache"}
)


def refuse_changed_config(checkpoint: str | Path, config) -> None:
    """Resuming loads the checkpoint's weights into the model this run built: built with other settings
    (`--config_overrides` changed between the runs), it would continue another architecture, or fail on a shape."""
    if not (Path(checkpoint) / "config.json").is_file():  # a LoRA checkpoint holds the adapter only
        return
    saved = type(config).from_pretrained(checkpoint).to_dict()
    current = config.to_dict()
    changed = sorted(
        name
        for name in saved.keys() | current.keys()
        if name not in BOOKKEEPING_CONFIG_FIELDS and saved.get(name) != current.get(name)
    )
    if changed:
        shown = ", ".join(f"{name}: {saved.get(name)!r} there, {current.get(name)!r} now" for name in changed[:8])
        raise ValueError(
            f"Cannot resume from {checkpoint}: its model was built with other settings than this run's ({shown}"
            f"{' ...' if len(changed) > 8 else ''}). Resume with the --config_overrides of the run that saved it, "
            "or start a new run."
        )


def refuse_diverged_checkpoint(checkpoint: str | Path) -> None:
    """A checkpoint whose weights hold NaN or infinite values was saved by a diverged run: resuming would train on
    garbage (`latest` does not fall back to an older checkpoint either, which would likely diverge again)."""
    broken = first_nonfinite_saved_weight(checkpoint)
    if broken is not None:
        raise ValueError(
            f"Cannot resume from {checkpoint}: its weight {broken} holds NaN or infinite values; the run had "
            "diverged when it saved it. Resume from an earlier checkpoint (--resume_from_checkpoint PATH) with a "
            "lower --learning_rate, or start again."
        )


# `torch.save` weight files: sharded or not, an adapter's, and FSDP's full (`pytorch_model_fsdp.bin`, one per model)
# and local (`pytorch_model_fsdp_rank0.bin`, one per process) state dicts.
SAVED_TORCH_WEIGHTS = re.compile(r"^(pytorch_model|adapter_model)(-\d+-of-\d+|_fsdp(_\d+|_rank\d+)?)?\.bin$")
# FSDP's sharded state dict: a `torch.distributed.checkpoint` folder (`.metadata` and `*.distcp` files).
FSDP_SHARDED_WEIGHTS = re.compile(r"^pytorch_model_fsdp_\d+$")


def first_nonfinite_saved_weight(folder: str | Path) -> str | None:
    """`"<tensor> in <file>"` for the first saved weight of `folder` holding a NaN or an infinity; None if all are
    finite. Reads safetensors, `torch.save` weight files and FSDP's sharded folders one tensor or one file at a time.
    (DeepSpeed's `global_step*` folders are not read: under ZeRO-3 their weights are partitions of the optimizer's.)"""
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as file:
                for key in file.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    tensor = file.get_tensor(key)
                    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        return f"{key} in {path.name}"
        elif path.is_file() and SAVED_TORCH_WEIGHTS.match(path.name):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for key, tensor in state.items():
                if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    return f"{key} in {path.name}"
        elif path.is_dir() and FSDP_SHARDED_WEIGHTS.match(path.name) and (path / ".metadata").is_file():
            broken = first_nonfinite_distributed_tensor(path)
            if broken is not None:
                return f"{broken} in {path.name}"
    return None


def first_nonfinite_distributed_tensor(folder: Path) -> str | None:
    """The first floating-point tensor of a `torch.distributed.checkpoint` folder that holds a NaN or an infinity,
    read whole (its shards joined) one tensor at a time, in this process alone; None if all are finite."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(folder).read_metadata()
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and item.properties.dtype.is_floating_point:
            tensor = torch.empty(item.size, dtype=item.properties.dtype)
            with warnings.catch_warnings():  # "... assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
            if not torch.isfinite(tensor).all():
                return key
    return None


# Fields of the scripts' argument dataclasses that name something the run reads (a local path, or a Hub name).
INPUT_FIELDS = (
    "model_name_or_path",
    "config_name",
    "tokenizer_name",
    "dataset_name",
    "train_file",
    "validation_file",
    "test_file",
)


def run_inputs(*arguments) -> list[tuple[str, str]]:
    """(flag, value) of every input that `arguments` (the scripts' argument dataclasses) name."""
    return [
        (f"--{name}", getattr(group, name))
        for group in arguments
        for name in INPUT_FIELDS
        if getattr(group, name, None) is not None
    ]


def prepare_output_dir(training_args: transformers.TrainingArguments, *arguments) -> str | None:
    """Check `--output_dir` before any work and return the checkpoint to resume from (see `checkpoint_to_resume`).

    First, an `--output_dir` that is, holds or lies inside something the run reads (the model, tokenizer or data
    named in `arguments`, the script's other argument dataclasses) is refused
    (`ran_hf.files.paths.check_not_inputs`). The process that saves then takes the lock on the folder for the whole
    run (`ran_hf.files.folder_locks.lock_folder`: a second run into it is refused, naming this one) and cleans up what a
    killed save left (`recover_interrupted`). Then a training run into a folder that already holds something (a
    finished run's model and metrics, or the checkpoints of another run) is refused unless it continues the run in that
    folder (`--resume_from_checkpoint` naming one of its checkpoints, or `latest` finding one) or
    `--overwrite_output_dir` is given. When overwriting, the old checkpoints are set aside now
    (`ran_hf.files.recovery.set_aside`, beside the folder, where `latest` never looks) and deleted once the final save
    is complete. They come back only if this run fails with an error before its first checkpoint; after that
    (`RANTrainer._save_checkpoint` retires them), or after a kill, never: a later `latest` continues this run. The old
    model, metrics and card are replaced by the final save (`RANTrainer.save_model`), never merged with the new run's.
    """
    output_dir = Path(training_args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output_dir {output_dir} is a file, not a folder.")
    check_not_inputs(output_dir, "--output_dir", run_inputs(*arguments))
    if training_args.should_save:
        lock_folder(output_dir)  # held until the script's main returns (or the process ends)
        for note in recover_interrupted(output_dir, carry_over=lambda name: not is_run_file(name)):
            logger.warning(f"Before this run: {note}.")
    checkpoint = checkpoint_to_resume(training_args)
    if not training_args.do_train or not output_dir.is_dir():
        return checkpoint
    entries = contents(output_dir)
    if not entries:
        return checkpoint
    if checkpoint is not None and Path(checkpoint).resolve().parent == output_dir.resolve():
        return checkpoint  # continuing the run this folder holds
    old_checkpoints = [path for path in checkpoints_in(output_dir) if path.is_dir()]
    if not getattr(training_args, "overwrite_output_dir", False):
        shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
        resume = "Pass --resume_from_checkpoint latest to continue it, " if old_checkpoints else "Pass "
        raise ValueError(
            f"--output_dir {output_dir} already holds a previous run ({shown}); training into it would replace that "
            f"run's model and mix their metrics. {resume}--overwrite_output_dir to replace it, or choose another "
            "--output_dir."
        )
    aside = ""
    if training_args.should_save and old_checkpoints:
        retired = set_aside(output_dir, [path.name for path in old_checkpoints])
        names = ", ".join(path.name for path in old_checkpoints)
        aside = (
            f"Moved its checkpoints ({names}) to {retired}, where --resume_from_checkpoint latest never finds them "
            "(put back only if this run fails before its first checkpoint), to be deleted once this run's model is "
            "saved; "
        )
    logger.warning(
        f"--overwrite_output_dir: {output_dir} held a previous run. {aside}its model, metrics and model card are "
        "replaced when this run saves its model."
    )
    return checkpoint
