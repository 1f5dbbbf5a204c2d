"""What the example training scripts (`scripts/<task>/run_*.py`) share to set a run up: the model and training
arguments, logging, the DDP setting, and loading the tokenizer, config and model (with LoRA for `--lora_r`).

The rest of their shared machinery sits beside this file, one concern each: `data_loading.py` (the data),
`checkpoints.py` (the output folder, resuming), `ran_trainer.py` (the `Trainer`), `model_cards.py` (the model card),
`argument_checks.py` (flag ranges). What only one task uses sits beside its scripts instead
(`language-modeling/lm_data.py`, say). Each script puts this folder, `scripts/`, on `sys.path` with one line before
importing these modules, so it runs from any working directory, under `python`, `torchrun` or `accelerate launch`.
"""

import logging
import math
import re
import sys
from dataclasses import dataclass, field

import datasets
import transformers
from argument_checks import (  # noqa: F401 (scripts import it)
    TRAINING_ARGUMENT_RANGES,
    apply_config_overrides,
    check_ranges,
    parse_arguments,
)
from ran_trainer import first_nonfinite_weight
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase, TrainingArguments
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import ran_hf  # noqa: F401 (registers RAN with the Auto classes and marks it for remote code on save)
from ran_hf import RAN_LORA_TARGET_MODULES, RANConfig, frozen_new_weights, ran_lora_config
from ran_hf.integrations.sentence_embeddings import SENTENCE_POOLINGS


logger = logging.getLogger(__name__)


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
            "(ran_hf.integrations.sentence_embeddings). `cell_transform` needs a trained pooler: run_classification.py only."
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

    RAN's cell-residual weights (`cell_scan.cell_glu`, `cell_scan.cell_norm` of every layer) get no gradient in a batch
    whose sequences all fit in one window, where no cell follows another. Transformers would turn
    `find_unused_parameters` off under activation checkpointing, which is safe here because RAN checkpoints with
    `use_reentrant=False`.
    """
    if training_args.ddp_find_unused_parameters is None:
        training_args.ddp_find_unused_parameters = True


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


# ---- tokenizer, config and model ---------------------------------------------------------------------------------


def check_model_type(name: str | None, trust_remote_code: bool = False, **hub_kwargs) -> None:
    """A model folder (or Hub repo) whose config.json names a `model_type` that neither Transformers nor ran_hf has
    registered is an error naming the folder, its model_type and the fix, before a tokenizer or config is read from
    it: Transformers' own error names neither (and a folder without a tokenizer failed on that first)."""
    if name is None:
        return
    try:
        config_dict, _ = PreTrainedConfig.get_config_dict(name, **hub_kwargs)
    except (OSError, ValueError):  # no config.json (a tokenizer's folder), or unreadable: the loaders say why
        return
    model_type = config_dict.get("model_type")
    remote_code = "AutoConfig" in (config_dict.get("auto_map") or {})
    if model_type is None or model_type in CONFIG_MAPPING or (remote_code and trust_remote_code):
        return
    raise ValueError(
        f"{name}: its config.json has model_type {model_type!r}, which neither Transformers nor ran_hf knows. "
        "These scripts train RAN models (model_type 'ran', registered by `import ran_hf`, which they do): give the "
        "folder of a RAN model (a run of these scripts saves one), or, for a model whose folder or Hub repo ships its "
        "own code (`auto_map` in config.json), pass --trust_remote_code."
    )


def model_hub_kwargs(model_args: ModelArguments) -> dict:
    """Where and how `--model_name_or_path` and the like are read (`check_model_type`'s keywords)."""
    return {
        "trust_remote_code": model_args.trust_remote_code,
        "cache_dir": model_args.cache_dir,
        "revision": model_args.model_revision,
        "token": model_args.token,
    }


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    name = model_args.tokenizer_name or model_args.model_name_or_path
    for model in (model_args.config_name, model_args.model_name_or_path):
        check_model_type(model, **model_hub_kwargs(model_args))
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
        check_model_type(model_args.config_name or model_args.model_name_or_path, **model_hub_kwargs(model_args))
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
            task_values = {name: getattr(config, name) for name in task_fields}
            apply_config_overrides(config, model_args.config_overrides)
            changed = [name for name, value in task_values.items() if getattr(config, name) != value]
            if "num_labels" in changed:  # which makes new label names: the override set num_labels only
                changed = [name for name in changed if name not in ("id2label", "label2id")]
            if changed:  # `num_labels=5` gave a model of 5 outputs named LABEL_0..4 for the data's 2 named classes
                names = ", ".join(f"`{name}`" for name in changed)
                values = ", ".join(f"{name}={task_values[name]!r:.80}" for name in changed)
                raise ValueError(
                    f"--config_overrides sets {names}, which the script sets itself from the task and the data "
                    f"({values}): leave {'it' if len(changed) == 1 else 'them'} out of --config_overrides."
                )
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
    check_model_type(name, **model_hub_kwargs(model_args))
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
