"""What every example training script (`scripts/<task>/run_*.py`) shares: model and training arguments, logging, the
output folder (refusing to train over a previous run unasked, resuming, an atomic final save), DDP settings, data and
tokenizer/config checks, LoRA (`--lora_r`), a parameter checksum hook and the model card.

What only one task uses sits beside its scripts instead (`language-modeling/lm_data.py`, say). Each script puts this
folder, `scripts/`, on `sys.path` with one line before importing this module, so it runs from any working directory,
under `python`, `torchrun` or `accelerate launch`.
"""

import hashlib
import json
import logging
import math
import os
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
from argument_checks import TRAINING_ARGUMENT_RANGES, check_ranges, parse_arguments  # noqa: F401 (scripts import it)
from datasets import Dataset, DatasetDict, load_dataset
from model_cards import write_model_card
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import ran_hf  # noqa: F401 (registers RAN with the Auto classes and marks it for remote code on save)
from ran_hf import RAN_LORA_TARGET_MODULES, RANConfig, frozen_new_weights, ran_lora_config
from ran_hf.data import check_columns, check_text, read_records
from ran_hf.folders import (
    check_not_inputs,
    contents,
    discard_set_aside,
    lock_folder,
    recover_interrupted,
    set_aside,
    write_folder,
)
from ran_hf.sentence_embeddings import (
    SENTENCE_POOLINGS,
    SENTENCE_TRANSFORMERS_FILES,
    write_sentence_transformers_config,
)

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
# the folder never shows one run's model with another run's metrics or card.
RUN_FILES = frozenset(
    {
        *WEIGHTS_NAMES,
        "config.json",
        "generation_config.json",
        "training_args.bin",
        "trainer_state.json",
        "README.md",
        "predict_results.txt",
        "predictions.txt",
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
        "configuration_ran.py",
        "modeling_ran.py",
        "cache_ran.py",
    }
)
# `--sentence_transformers_pooling` adds sentence-transformers' files (and `1_Pooling/` for mean and max pooling).
RUN_FILES = RUN_FILES | {*SENTENCE_TRANSFORMERS_FILES, "1_Pooling"}
# A LoRA run (`--lora_r`) saves the adapter (and the head modules it trains in full), not the model.
ADAPTER_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
RUN_FILES = RUN_FILES | {*ADAPTER_NAMES, "adapter_config.json"}
WEIGHT_SHARD_PATTERN = re.compile(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")
# Files `Trainer` loads to resume, checked to load before a checkpoint is chosen.
RESUMED_TORCH_FILES = re.compile(
    r"^(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|pytorch_model.*\.bin)$"
)


def is_run_file(name: str) -> bool:
    return name in RUN_FILES or name.endswith("_results.json") or bool(WEIGHT_SHARD_PATTERN.match(name))


@dataclass
class RANTrainingArguments(TrainingArguments):
    """`TrainingArguments` with `--overwrite_output_dir`, as Transformers' example scripts had it, and a learning-rate
    warmup by default."""

    warmup_steps: float = field(
        default=0.1,
        metadata={
            "at_least": 0,
            "help": "Linear warmup from 0 to --learning_rate: a number of steps, or a fraction in [0, 1) of all steps "
            "(default 0.1; Transformers' default is 0). Trained at the full rate from the first step, a RAN's cell "
            "write and memory review can lock onto what they happen to pick first, and its memory then never "
            "learns (docs/memory.md, cause 7).",
        },
    )

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train into an --output_dir that already holds a previous run: its checkpoints are deleted at the "
            "start, its model, metrics and model card replaced when the new model is saved. Without it such a "
            "folder is refused (unless --resume_from_checkpoint continues the run in it)."
        },
    )

    max_nonfinite_steps: int = field(
        default=3,
        metadata={
            "at_least": 1,
            "help": "Stop the run, before anything more is saved or pushed, when this many optimizer steps in a row "
            "had a NaN or infinite loss or gradient norm (a step that fp16's loss scaler skipped does not count: "
            "the scaler recovers from those). A diverged run does not recover; its weights soon are NaN too.",
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_ranges(self, TRAINING_ARGUMENT_RANGES)


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to start from (one set of arguments for every training script)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Checkpoint to start from: a Hub model id or a folder. Leave out to train from scratch."},
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Config to use when it is not the one of `model_name_or_path`."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "From scratch only: RANConfig fields to change, e.g. "
            "`hidden_size=128,num_hidden_layers=2,num_attention_heads=4,head_dim=32,window_size=128`. "
            "`vocab_size` and `pad_token_id` follow the tokenizer unless given here."
        },
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer (Hub id or folder) when it is not the one of `model_name_or_path`."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where Hub downloads are stored."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of a Hub model."})
    token: str | None = field(
        default=None, metadata={"help": "Hub token (defaults to the one `hf auth login` saved)."}
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Let other model types load their own code from the Hub (RAN's is installed with ran_hf)."},
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={"help": "Fine-tuning: re-initialise a head whose shape differs (e.g. another number of labels)."},
    )
    lora_r: int = field(
        default=0,
        metadata={
            "help": "Fine-tune with LoRA of this rank (PEFT; `pip install ran-hf[peft]`) instead of training every "
            "weight: the model is frozen, low-rank adapters are trained on the --lora_target_modules, and the "
            "output folder holds the adapter (adapter_config.json, adapter_model.safetensors), which loads on the "
            "--model_name_or_path model. New head modules (a classifier's pooler and classifier) are trained in full "
            "and saved with the adapter. 0: no LoRA."
        },
    )
    lora_alpha: int = field(default=16, metadata={"above": 0, "help": "LoRA scaling: the update is (alpha / r) B A."})
    lora_dropout: float = field(
        default=0.0, metadata={"at_least": 0, "below": 1, "help": "Dropout on the input of the LoRA adapters."}
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(RAN_LORA_TARGET_MODULES),
        metadata={
            "help": "Names (suffixes) of the linear layers to adapt; defaults to ran_hf.RAN_LORA_TARGET_MODULES, "
            "the attention projections of window attention and memory review. `all-linear` adapts every linear "
            "layer but the output layer."
        },
    )
    sentence_transformers_pooling: str | None = field(
        default=None,
        metadata={
            "help": "Encoders (run_classification.py, run_mlm.py, run_ner.py): also write sentence-transformers' "
            "files into the saved model, so that `SentenceTransformer(output_dir, trust_remote_code=True)` embeds "
            f"documents with this RAN representation: one of {', '.join(SENTENCE_POOLINGS)} "
            "(ran_hf.sentence_embeddings). `cell_transform` needs a trained pooler: run_classification.py only."
        },
    )
    parameter_checksum_dir: str | None = field(
        default=None,
        metadata={
            "help": "Debugging data parallelism: at the end of training every process writes the SHA-256 of its "
            "parameters to `<dir>/rank-<N>.json`; all ranks must agree."
        },
    )

    def __post_init__(self):
        if self.config_overrides is not None and (self.config_name or self.model_name_or_path):
            raise ValueError("--config_overrides only applies when training from scratch (no --model_name_or_path).")
        if self.model_name_or_path is None and self.tokenizer_name is None:
            raise ValueError("Training from scratch needs --tokenizer_name (see scripts/train_tokenizer.py).")
        if self.lora_r < 0:
            raise ValueError(f"--lora_r must be 0 (no LoRA) or a positive rank, got {self.lora_r}.")
        if self.lora_r > 0 and self.model_name_or_path is None:
            raise ValueError(
                "--lora_r adapts a trained model: pass --model_name_or_path (a model from scratch has "
                "random weights for the adapters to adapt, and they would not be saved)."
            )
        if self.sentence_transformers_pooling is not None:
            if self.sentence_transformers_pooling not in SENTENCE_POOLINGS:
                raise ValueError(
                    f"--sentence_transformers_pooling must be one of {SENTENCE_POOLINGS}, "
                    f"got {self.sentence_transformers_pooling!r}."
                )
            if self.lora_r > 0:
                raise ValueError("--sentence_transformers_pooling needs a whole model; a LoRA run saves an adapter.")
        if self.lora_target_modules == ["all-linear"]:
            # PEFT's keyword is a str; one module name stays a list, since PEFT reads a str as a regular expression
            self.lora_target_modules = "all-linear"


# ---- arguments, logging and distributed settings ----------------------------------------------------------------


def setup_logging(training_args: transformers.TrainingArguments, script_logger: logging.Logger) -> None:
    """Log to stdout at the process's level (replicas quieter than the main process), as Transformers' examples do."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    for module_logger in (logger, script_logger):
        module_logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        f"Process rank {training_args.process_index} of {training_args.world_size}, device {training_args.device}, "
        f"distributed: {training_args.parallel_mode.value == 'distributed'}, "
        f"mixed precision: {training_args.mixed_precision}"
    )


def configure_data_parallelism(training_args: transformers.TrainingArguments) -> None:
    """Let DDP skip parameters that receive no gradient in a step, unless the user chose otherwise.

    RAN's cell-residual weights (`cell_glu`, `cell_norm` of every layer) get no gradient in a batch whose sequences all
    fit in one window, where no cell follows another. Transformers would turn `find_unused_parameters` off under
    activation checkpointing, which is safe here because RAN checkpoints with `use_reentrant=False`.
    """
    if training_args.ddp_find_unused_parameters is None:
        training_args.ddp_find_unused_parameters = True


# ---- checkpoints -------------------------------------------------------------------------------------------------


def missing_from_checkpoint(folder: str | Path) -> list[str]:
    """What a checkpoint folder lacks to resume from (empty when complete).

    Trainer writes `checkpoint-N/` in place: weights, then optimizer, scheduler and RNG states, and `trainer_state.json`
    last. A run killed while saving leaves a folder without (or with a truncated) `trainer_state.json`.
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


def prepare_output_dir(training_args: RANTrainingArguments, *arguments) -> str | None:
    """Check `--output_dir` before any work and return the checkpoint to resume from (see `checkpoint_to_resume`).

    First, an `--output_dir` that is, holds or lies inside something the run reads (the model, tokenizer or data
    named in `arguments`, the script's other argument dataclasses) is refused (`ran_hf.folders.check_not_inputs`).
    The process that saves then takes the lock on the folder for the whole run (`ran_hf.folders.lock_folder`: a second
    run into it is refused, naming this one) and cleans up what a killed save left (`recover_interrupted`).
    Then a training run into a folder that already holds something (a finished run's model and metrics, or the
    checkpoints of another run) is refused unless it continues the run in that folder (`--resume_from_checkpoint`
    naming one of its checkpoints, or `latest` finding one) or `--overwrite_output_dir` is given. When overwriting,
    the old checkpoints are set aside now (a later `latest` would otherwise pick them) and deleted once the final save
    is complete; the old model, metrics and card are replaced by the final save (`RANTrainer.save_model`), never
    merged with the new run's.
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
    if training_args.should_save and old_checkpoints:
        set_aside(output_dir, [path.name for path in old_checkpoints])
    names = ", ".join(path.name for path in old_checkpoints)
    aside = f"Set its checkpoints aside ({names}), to be deleted once this run's model is saved; " if names else ""
    logger.warning(
        f"--overwrite_output_dir: {output_dir} held a previous run. {aside}its model, metrics and model card are "
        "replaced when this run saves its model."
    )
    return checkpoint


def check_training_length(training_args: transformers.TrainingArguments) -> None:
    """`--max_steps 0` or `--num_train_epochs 0` (or negative) would save an untrained model with a model card."""
    if not training_args.do_train or training_args.max_steps > 0:
        return
    if training_args.max_steps != -1:
        raise ValueError(
            f"--max_steps must be positive (or -1, the default, to train for --num_train_epochs), got "
            f"{training_args.max_steps}."
        )
    epochs = training_args.num_train_epochs
    if not math.isfinite(epochs) or epochs <= 0:
        raise ValueError(f"--num_train_epochs must be positive, got {epochs}: the run would save an untrained model.")


# ---- data ----------------------------------------------------------------------------------------------------------


def load_splits(
    model_args: ModelArguments,
    dataset_name: str | None,
    dataset_config_name: str | None,
    files: dict[str, str | None],
    columns: list[str],
    optional_columns: tuple[str, ...] = (),
    text_columns: tuple[str, ...] = (),
) -> DatasetDict:
    """Splits from the Hub (`dataset_name`) or from local files (`{"train": path, ...}`), checked for `columns`.

    Local files are read with `ran_hf.data` (jsonl / jsonl.gz / csv / tsv / text) and keep only `columns`, plus those
    of `optional_columns` that their first record holds (a test file without labels, say). Every value of
    `text_columns` must be a string that is not blank (the error names the file and line, or the split and example).
    """
    if dataset_name is not None:
        splits = load_dataset(
            dataset_name, dataset_config_name, cache_dir=model_args.cache_dir, token=model_args.token
        )
        for split, dataset in splits.items():
            check_columns([dict.fromkeys(dataset.column_names)], columns, f"{dataset_name} ({split})")
            if text_columns:  # in batches: a corpus's whole text column need not fit in memory as Python strings
                for start, batch in enumerate(dataset.select_columns(list(text_columns)).iter(batch_size=1000)):
                    for column in text_columns:
                        for offset, value in enumerate(batch[column]):
                            where = f"{dataset_name} ({split}), example {1000 * start + offset + 1}"
                            check_text(value, where, column)
        return splits
    splits = DatasetDict()
    for split, path in files.items():
        if path is None:
            continue
        records = read_records(path, text_columns)
        kept = columns + [column for column in optional_columns if column in records[0]]
        check_columns(records, kept, str(path))
        splits[split] = Dataset.from_dict({column: [record[column] for record in records] for column in kept})
    return splits


def check_data_limits(data_args) -> None:
    """The data flags every script's `DataTrainingArguments` may have, checked when parsed: `--max_*_samples` keep
    the first N examples (below 1, nothing would be left to train on or score), `--validation_split_percentage` holds
    out part of the training data (100 would leave none to train on)."""
    for name, value in vars(data_args).items():
        if name.startswith("max_") and name.endswith("_samples") and value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1 (leave it out to keep every example), got {value}.")
    percentage = getattr(data_args, "validation_split_percentage", None)
    if percentage is not None and not 0 <= percentage < 100:
        raise ValueError(
            f"--validation_split_percentage must be in [0, 100) (0: no split held out), got {percentage}."
        )


def describe_source(data_args) -> str:
    """ "Hub dataset `name` (`config`)" or the data files, for a model card."""
    if data_args.dataset_name:
        config = f" (`{data_args.dataset_config_name}`)" if data_args.dataset_config_name else ""
        return f"Hub dataset `{data_args.dataset_name}`{config}"
    files = [
        f"{split} `{getattr(data_args, f'{split}_file')}`"
        for split in ("train", "validation", "test")
        if getattr(data_args, f"{split}_file", None)
    ]
    return ", ".join(files)


def cut_for_tokenizer(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int) -> list[str]:
    """The texts, long ones cut to a part that still gives more than `max_length` tokens, to tokenize with truncation.

    A fast tokenizer tokenizes a whole text before truncating it: a 50 MB single-line document cost 8 GB and 100 s to
    keep 256 tokens. Cutting first bounds the cost by `max_length`. Cuts fall on whitespace (where pre-tokenizers
    split) and keep a margin of tokens beyond `max_length`, so the truncated ids are the ones the whole text gives.
    The kept part is the start, or the end for a tokenizer that truncates on the left.
    """
    from_left = tokenizer.truncation_side == "left"
    needed = max_length + 16
    # Text without whitespace (a 50 MB run of one "word") gives few tokens however much of it is read (WordPiece: one
    # [UNK]), and read whole it took 3.3 GB and 150 s: parts grow to at most 256 characters a token kept.
    longest = 256 * needed
    cut_texts = []
    for text in texts:
        characters = 16 * needed
        while len(text) > characters:
            part = cut_at_whitespace(text, characters, from_left)
            if (
                characters >= longest
                or len(tokenizer(part, add_special_tokens=False, return_attention_mask=False)["input_ids"]) >= needed
            ):
                text = part
                break
            characters = min(4 * characters, longest)
        cut_texts.append(text)
    return cut_texts


def cut_at_whitespace(text: str, characters: int, from_left: bool) -> str:
    """The last `characters` characters of `text` (from_left) or the first, shortened to a whitespace boundary."""
    if from_left:
        part = text[-characters:]
        starts = [index for index in (part.find(space) for space in " \t\n\r") if index >= 0]
        return part[min(starts) :] if starts else part
    part = text[:characters]
    end = max(part.rfind(space) for space in " \t\n\r")
    return part[:end] if end > 0 else part


# ---- tokenizer, config and model ---------------------------------------------------------------------------------


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    name = model_args.tokenizer_name or model_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(
        name,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    if tokenizer.pad_token_id is None:
        raise ValueError(f"The tokenizer {name} has no padding token; RAN batches need one (id 0 by default).")
    return tokenizer


def load_config(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase, **task_fields) -> RANConfig:
    """The model's config with the task's fields (labels, `is_causal`, ...), checked against the tokenizer."""
    hub_kwargs = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision, "token": model_args.token}
    if model_args.config_name or model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(
            model_args.config_name or model_args.model_name_or_path,
            trust_remote_code=model_args.trust_remote_code,
            **hub_kwargs,
            **task_fields,
        )
    else:
        logger.warning("Training a new RAN from scratch.")
        fields = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **task_fields}
        config = RANConfig(**fields)
        if model_args.config_overrides:
            logger.info(f"Config overrides: {model_args.config_overrides}")
            config.update_from_string(model_args.config_overrides)
            config = RANConfig(**config.to_dict())  # validates the overridden fields, naming a bad one
    check_tokenizer_matches_config(tokenizer, config)
    return config


DEFAULT_LABEL = re.compile(r"^LABEL_(\d+)$")


def trained_labels(model_args: ModelArguments) -> tuple[tuple[str, ...], str | None] | None:
    """The classes of `--model_name_or_path` (or `--config_name`) in the order of its outputs, and its
    `problem_type`, when its head was trained on named classes; None when no model is given or its `id2label` holds
    only Transformers' placeholder names (`LABEL_0`, `LABEL_1`, ...).

    A fine-tuned classifier's `id2label` is what its outputs mean: a script evaluating or training it further must
    keep those classes in that order, never re-infer them from the data."""
    name = model_args.config_name or model_args.model_name_or_path
    if name is None:
        return None
    config = AutoConfig.from_pretrained(
        name,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    id2label = {int(index): str(label) for index, label in (getattr(config, "id2label", None) or {}).items()}
    placeholders = all(
        (match := DEFAULT_LABEL.match(label)) and int(match.group(1)) == index for index, label in id2label.items()
    )
    if not id2label or placeholders:
        return None
    return tuple(id2label[index] for index in sorted(id2label)), getattr(config, "problem_type", None)


def check_tokenizer_matches_config(tokenizer: PreTrainedTokenizerBase, config) -> None:
    """A tokenizer that can emit ids the embedding does not have, or pads with another id, is an error."""
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {config.vocab_size}: token ids "
            f">= {config.vocab_size} would have no embedding. Use the tokenizer the model was trained with."
        )
    if config.pad_token_id is not None and tokenizer.pad_token_id != config.pad_token_id:
        raise ValueError(
            f"The tokenizer pads with id {tokenizer.pad_token_id} ({tokenizer.pad_token!r}) but the model config has "
            f"pad_token_id={config.pad_token_id}. Use the tokenizer the model was trained with."
        )
    if len(tokenizer) < config.vocab_size:
        logger.info(f"The model's vocabulary ({config.vocab_size}) is larger than the tokenizer's ({len(tokenizer)}).")


def load_model(auto_class, model_args: ModelArguments, config):
    """Weights from `--model_name_or_path`, or a freshly initialised model from `config`; with `--lora_r`, that
    model wrapped for LoRA (`wrap_with_lora`)."""
    if model_args.model_name_or_path is None:
        model = auto_class.from_config(config)
        logger.info(f"New {type(model).__name__} with {model.num_parameters():,} parameters")
        return model
    model, loading_info = auto_class.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
        output_loading_info=True,
    )
    broken = first_nonfinite_weight(model)
    if broken is not None:
        raise ValueError(
            f"--model_name_or_path {model_args.model_name_or_path}: its weight {broken} holds NaN or infinite "
            "values (a diverged or damaged model); training or evaluating it would give NaN. Use another checkpoint."
        )
    if model_args.lora_r > 0:
        new_weights = {*loading_info["missing_keys"], *(key for key, *_ in loading_info["mismatched_keys"])}
        model = wrap_with_lora(model, model_args, new_weights)
    return model


def wrap_with_lora(model, model_args: ModelArguments, new_weights: set[str]):
    """The model as a PEFT LoRA model (`ran_hf.ran_lora_config`: the head's new modules trained in full); fails if
    a newly initialised weight would stay frozen at its random value."""
    try:
        from peft import get_peft_model
    except ImportError as error:
        raise ImportError("--lora_r needs PEFT: `pip install ran-hf[peft]` (or `pip install peft`).") from error
    lora_config = ran_lora_config(
        model,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
    )
    model = get_peft_model(model, lora_config)
    frozen = frozen_new_weights(model, new_weights)
    if frozen:
        raise ValueError(
            f"LoRA would leave these newly initialised weights frozen at their random values: {', '.join(frozen)}. "
            "Start from a checkpoint that has them, or train without --lora_r."
        )
    trainable, total = model.get_nb_trainable_parameters()
    logger.info(
        f"LoRA (r={model_args.lora_r}, alpha={model_args.lora_alpha}) on {lora_config.target_modules}, trained in "
        f"full: {lora_config.modules_to_save or 'nothing'}; {trainable:,} of {total:,} parameters trainable "
        f"({trainable / total:.2%})"
    )
    return model


# ---- non-finite values: diverged runs and broken weights ----------------------------------------------------------


class TrainingDivergedError(RuntimeError):
    """The loss or the gradients stayed NaN or infinite: the run stops instead of saving what it learned."""


def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """The name of the first parameter or floating-point buffer holding a NaN or an infinity; None if all are finite.

    Under FSDP each process checks its own shard (a DTensor's local part); DeepSpeed's placeholders are empty."""
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        tensor = tensor.detach()
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(tensor).all():
            return name
    return None


SAVED_TORCH_WEIGHTS = re.compile(r"^(pytorch_model|adapter_model)(-\d+-of-\d+)?\.bin$")


def first_nonfinite_saved_weight(folder: str | Path) -> str | None:
    """`"<tensor> in <file>"` for the first saved weight of `folder` holding a NaN or an infinity; None if all are
    finite. Reads safetensors and `torch.save` weight files one tensor or one file at a time."""
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as file:
                for key in file.keys():
                    tensor = file.get_tensor(key)
                    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        return f"{key} in {path.name}"
        elif path.is_file() and SAVED_TORCH_WEIGHTS.match(path.name):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for key, tensor in state.items():
                if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    return f"{key} in {path.name}"
    return None


class DivergenceGuard:
    """Counts the optimizer steps in a row whose loss or gradient norm is NaN or infinite, and stops the run at
    `limit` of them.

    The losses of a step's micro-batches are combined on the device; the step is read back once (one host read per
    optimizer step). A step that fp16's loss scaler skipped for infinite gradients does not count: the weights are
    untouched and the scaler lowers its scale. Its loss still counts, since the forward pass does not depend on it.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.step_losses_finite = None  # all micro-batch losses of the current step finite, on the device
        self.last_loss = None
        self.bad_steps = []  # global steps of the current run of non-finite steps
        self.checked_step = None

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        finite = torch.isfinite(loss).all()
        self.step_losses_finite = finite if self.step_losses_finite is None else self.step_losses_finite & finite
        self.last_loss = loss

    def end_step(self, global_step: int, grad_norm, step_skipped: bool) -> None:
        """After the optimizer step `global_step` (and before anything is logged or saved for it)."""
        if global_step == self.checked_step:  # the epoch's end repeats the last step's logging call
            return
        self.checked_step = global_step
        finite = self.step_losses_finite
        if grad_norm is not None and not step_skipped:
            norm_finite = torch.isfinite(torch.as_tensor(grad_norm)).all()
            finite = norm_finite if finite is None else finite & norm_finite.to(finite.device)
        self.step_losses_finite = None
        if finite is None or bool(finite):
            self.bad_steps = []
            return
        self.bad_steps.append(global_step)
        if len(self.bad_steps) >= self.limit:
            loss = "unknown" if self.last_loss is None else f"{self.last_loss.float().mean().item():g}"
            norm = "not computed" if grad_norm is None else f"{float(grad_norm):g}"
            count, first = len(self.bad_steps), self.bad_steps[0]
            if count > 1:
                steps = f"{count} optimizer steps in a row, steps {first} to {global_step}"
            else:
                steps = f"optimizer step {global_step}"
            raise TrainingDivergedError(
                f"Training diverged: the loss or the gradient norm was NaN or infinite at {steps} (last loss {loss}, "
                f"gradient norm {norm}). The run stops here and saves nothing more; checkpoints saved before step "
                f"{first} are kept. Lower --learning_rate, lengthen --warmup_steps or set "
                "--max_grad_norm, and resume from such a checkpoint or start again (--max_nonfinite_steps sets how "
                "many such steps in a row stop a run)."
            )


# ---- parameter checksums ------------------------------------------------------------------------------------------


def parameter_checksum(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name and float32 bytes, in `named_parameters` order (tied weights once)."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class ParameterChecksumCallback(TrainerCallback):
    """At the end of training, every process writes `{"rank", "global_step", "sha256"}` to `<folder>/rank-<N>.json`."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"rank": args.process_index, "global_step": state.global_step, "sha256": parameter_checksum(model)}
        (self.folder / f"rank-{args.process_index}.json").write_text(json.dumps(record) + "\n")
        logger.warning(
            f"Parameter checksum of rank {args.process_index} at step {state.global_step}: {record['sha256']}"
        )


# ---- model card ----------------------------------------------------------------------------------------------------


class RANTrainer(Trainer):
    """`Trainer` whose model card (written by `create_model_card`, and so by `push_to_hub`) is RAN's own.

    `card` holds what only the script knows: the task, the data, intended use and limitations (see `write_model_card`).
    With `sentence_transformers_pooling`, the final save also writes sentence-transformers' files
    (`ran_hf.sentence_embeddings.write_sentence_transformers_config`) beside the model, in the same atomic step.
    """

    def __init__(self, *args, card: dict | None = None, sentence_transformers_pooling: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.card = card or {}
        self.sentence_transformers_pooling = sentence_transformers_pooling
        self.divergence_guard = DivergenceGuard(getattr(self.args, "max_nonfinite_steps", 3))
        if sentence_transformers_pooling == "cell_transform" and not any(
            name.rsplit(".", 1)[-1] == "pooler" for name, _ in self.model.named_modules()
        ):
            raise ValueError(
                f"--sentence_transformers_pooling cell_transform needs a trained pooler, which a "
                f"{type(self.model).__name__} does not have: choose pooled_cell, mean or max."
            )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, str | Path):
            refuse_changed_config(resume_from_checkpoint, self.accelerator.unwrap_model(self.model).config)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.divergence_guard.add_loss(loss)
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs) -> None:
        """Stops a diverged run (`DivergenceGuard`) after each optimizer step, before it is logged or saved."""
        self.divergence_guard.end_step(
            self.state.global_step, grad_norm, step_skipped=self.accelerator.optimizer_step_was_skipped
        )
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def refuse_nonfinite_weights(self, output_dir: str | None) -> None:
        broken = first_nonfinite_weight(self.model)
        if broken is not None:
            raise TrainingDivergedError(
                f"Refusing to save the model to {output_dir or self.args.output_dir}: its weight {broken} holds NaN "
                "or infinite values; the run diverged. Lower --learning_rate, lengthen --warmup_steps or set "
                "--max_grad_norm, and start again or resume from an earlier checkpoint."
            )

    def write_sentence_transformers_files(self, folder: str | Path) -> None:
        if self.sentence_transformers_pooling is not None:
            write_sentence_transformers_config(folder, pooling=self.sentence_transformers_pooling)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The final save (into `--output_dir`) goes through `ran_hf.folders.write_folder`: the model is written
        into a temporary folder, which then replaces the old one (its contents, for a mount point); checkpoints and
        other entries of the old folder stay, its previous model, metrics and card do not. A full disk or a kill
        leaves the old model or the new one, whole. Checkpoint saves, other ranks and DeepSpeed saves are Transformers' own. Weights that are NaN or
        infinite are never saved."""
        self.refuse_nonfinite_weights(output_dir)
        final = output_dir is None or os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir)
        if not final or not self.args.should_save or self.is_deepspeed_enabled:
            super().save_model(output_dir, _internal_call=_internal_call)
            return
        written = set()
        with write_folder(self.args.output_dir, "saving", carry_over=lambda name: not is_run_file(name)) as staging:
            super().save_model(str(staging), _internal_call=True)
            if any(staging.iterdir()):
                self.write_sentence_transformers_files(staging)
            written = {path.name for path in staging.iterdir()}
        if written:
            discard_set_aside(self.args.output_dir)  # the old run's checkpoints (--overwrite_output_dir)
        else:  # nothing to publish (a sharded FSDP state, say): the folder stays as it is
            super().save_model(output_dir, _internal_call=True)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, **kwargs) -> None:
        if self.is_world_process_zero():
            write_model_card(self, **{**self.card, **kwargs})
