"""The model card a training script writes beside the model it saves (`README.md`): `ran_hf/model_cards/TEMPLATE.md`
filled from the run. Its metadata is built with `huggingface_hub`'s `ModelCardData`: the base model (when it is a Hub
id, never a local path), the datasets, and the evaluation metrics as a `model-index`, so the Hub shows them."""

import json
import math
import re
import string
from importlib import resources
from pathlib import Path

import datasets
import torch
import transformers
from huggingface_hub import EvalResult, ModelCardData
from transformers import Trainer
from transformers.utils import logging

import ran_hf


logger = logging.get_logger(__name__)

MODEL_CARD_TEMPLATE = resources.files("ran_hf").joinpath("model_cards").joinpath("TEMPLATE.md")
# What a causal model's card says of its associative memory, with the state-tracking table of the design.
CAUSAL_MEMORY_WORDS = resources.files("ran_hf").joinpath("model_cards").joinpath("causal_memory.md")
# What all_results.json holds besides metrics: how long, how fast.
NOT_METRICS = ("_runtime", "_per_second", "_samples", "total_flos", "epoch")


FULL_MODEL_USE = """\
The model code travels with the weights (`configuration_ran.py`, `modeling_ran.py`), so the model loads with
`trust_remote_code=True` without installing anything beyond Transformers and PyTorch:

```python
from transformers import {auto_class}, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{repo_id}")
model = {auto_class}.from_pretrained("{repo_id}", trust_remote_code=True)
```

With `ran_hf` installed (`import ran_hf`), the same call uses the installed code instead."""

ADAPTER_USE = """\
This folder holds a LoRA adapter, not a whole model: `adapter_config.json` and `adapter_model.safetensors` (the
adapter weights{saved_modules}). It loads on its base model, `{base}`, with PEFT installed (`pip install peft`):

```python
import ran_hf  # RAN's classes (or pass trust_remote_code=True where the base model holds its code)
from peft import PeftModel
from transformers import {auto_class}, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{repo_id}")
base = {auto_class}.from_pretrained("{base}"{load_kwargs})
model = PeftModel.from_pretrained(base, "{repo_id}")
model = model.merge_and_unload()  # optional: a plain model, as fast as the base
```"""


def design_words(config) -> str:
    """What the card adds to the paper's description for the layer `config` builds: the official layer's origin, or
    a causal model's associative memory (`causal_memory.md`, its figure markers left out); nothing otherwise."""
    if config.layer_design == "official":
        return (
            " Its layers are the official implementation's (`layer_design=\"official\"`), those of `rannet`'s "
            "checkpoints."
        )
    if config.is_causal and config.associative_memory:
        words = re.sub(r"<!--.*?-->\n?", "", CAUSAL_MEMORY_WORDS.read_text(encoding="utf-8"), flags=re.DOTALL)
        return "\n\n" + words.strip()
    return ""


def write_model_card(
    trainer: Trainer,
    task: str,
    pipeline_tag: str,
    auto_class: str,
    data: str,
    intended_use: str,
    limitations: str,
    model_name: str | None = None,
    finetuned_from: str | None = None,
    dataset: str | list[str] | None = None,
    tags: list[str] | None = None,
    **unused,
) -> Path:
    """Fill `ran_hf/model_cards/TEMPLATE.md` from the run (config, hyperparameters, the saved `all_results.json`) and
    write it to `README.md` in the output folder, next to the saved model."""
    args, model = trainer.args, trainer.accelerator.unwrap_model(trainer.model)
    config = model.config
    lora = model.peft_config.get("default") if hasattr(model, "peft_config") else None
    output_dir = Path(args.output_dir)
    if model_name is None:
        named = args.hub_model_id or (args.run_name if args.run_name not in (None, args.output_dir) else None)
        model_name = named.split("/")[-1] if named else output_dir.name
    results_file = output_dir / "all_results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    shown_metrics = [name for name in sorted(results) if not name.endswith("_per_second") and name != "total_flos"]

    datasets_field = [dataset] if isinstance(dataset, str) else list(dataset or [])
    on_hub = bool(finetuned_from) and not Path(finetuned_from).exists()
    metadata = ModelCardData(
        library_name="transformers" if lora is None else "peft",
        pipeline_tag=pipeline_tag,
        license="apache-2.0",
        tags=["ran", "recurrent-attention-network", "long-document", *(["lora"] if lora else []), *(tags or [])],
        datasets=datasets_field or None,
        base_model=finetuned_from if on_hub else None,
        model_name=model_name,
        eval_results=evaluation_results(results, pipeline_tag, datasets_field) or None,
    )

    world_size = args.world_size
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    steps = trainer.state.global_step
    length = f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs:g} epochs"
    hyperparameters = [
        ("learning rate", f"{args.learning_rate:g}"),
        (
            "schedule",
            f"{args.lr_scheduler_type.value}, warmup "
            + (
                f"{args.warmup_steps:.0%} of the steps"
                if 0 < args.warmup_steps < 1
                else f"{args.warmup_steps:g} steps"
            ),
        ),
        ("optimizer", f"{args.optim.value}, weight decay {args.weight_decay:g}"),
        (
            "batch size",
            (
                f"{batch} ({args.per_device_train_batch_size} per device x {world_size} processes x "
                f"{args.gradient_accumulation_steps} accumulation steps)"
            ),
        ),
        ("training length", f"{length} ({steps} optimizer steps done)"),
        ("precision", "float32" if args.mixed_precision in (None, "no") else args.mixed_precision),
        ("seed", str(args.seed)),
    ]
    if lora is not None:
        trainable, total = model.get_nb_trainable_parameters()
        # PEFT adds its own defaults for the task ("classifier", "score"): name only the modules the model has.
        module_names = [name for name, _ in model.get_base_model().named_modules()]
        saved_modules = sorted(
            saved
            for saved in set(lora.modules_to_save or ())
            if any(name == saved or name.endswith(f".{saved}") for name in module_names)
        )
        targets = lora.target_modules
        targets = targets if isinstance(targets, str) else ", ".join(sorted(targets))
        hyperparameters.append(
            (
                "LoRA",
                f"r={lora.r}, alpha={lora.lora_alpha}, dropout={lora.lora_dropout:g} on {targets}"
                + (f"; trained in full: {', '.join(saved_modules)}" if saved_modules else "")
                + f"; {trainable:,} of {total:,} parameters trained ({trainable / total:.2%})",
            )
        )
    architecture = [
        ("parameters", f"{model.num_parameters():,}"),
        ("hidden size / layers", f"{config.hidden_size} / {config.num_hidden_layers}"),
        ("heads x head size", f"{config.num_attention_heads} x {config.head_dim}"),
        (
            "window / minimum window / overlap",
            f"{config.window_size} / {config.min_window_size} / {config.window_overlap}",
        ),
        ("windows drawn in training", ", ".join(map(str, config.training_window_sizes or [config.window_size]))),
        ("cell pooling, memory review", f"{config.cell_pooling}, {config.memory_review}"),
        ("causal", str(config.is_causal)),
        ("layer design", config.layer_design),
        (
            "associative memory (key convolution, decay)",
            f"{config.associative_memory} ({config.associative_key_conv}, {config.associative_decay})"
            if config.associative_memory
            else "False",
        ),
        ("vocabulary", f"{config.vocab_size:,}"),
    ]
    repo_id = args.hub_model_id or output_dir.name  # a local folder by its name: its path is this machine's
    if lora is None:
        adapter = ""
        how_to_use = FULL_MODEL_USE.format(auto_class=auto_class, repo_id=repo_id)
    else:
        adapter = f" This is a LoRA adapter (rank {lora.r}) for that model, not a whole model (see How to use)."
        labels = {int(index): name for index, name in config.id2label.items()}
        classifier = auto_class.endswith("Classification")
        load_kwargs = f", num_labels={config.num_labels}, id2label={labels!r}" if classifier else ""
        how_to_use = ADAPTER_USE.format(
            auto_class=auto_class,
            repo_id=repo_id,
            base=lora.base_model_name_or_path or finetuned_from,
            load_kwargs=load_kwargs,
            saved_modules=f", and the {', '.join(saved_modules)} trained in full" if saved_modules else "",
        )
    values = {
        "front_matter": metadata.to_yaml(),
        "model_name": model_name,
        "task": task,
        "design": design_words(config),
        "base": base_model_words(finetuned_from, on_hub),
        "adapter": adapter,
        "how_to_use": how_to_use,
        "data": data,
        "results": markdown_table(("metric", "value"), [(name, format_value(results[name])) for name in shown_metrics])
        if shown_metrics
        else "No metrics were recorded.",
        "hyperparameters": markdown_table(("setting", "value"), hyperparameters),
        "architecture": markdown_table(("field", "value"), architecture),
        "intended_use": intended_use,
        "limitations": limitations,
        "versions": (
            f"ran_hf {ran_hf.__version__}, Transformers {transformers.__version__}, PyTorch {torch.__version__}, "
            f"Datasets {datasets.__version__}"
        ),
    }
    card = string.Template(MODEL_CARD_TEMPLATE.read_text(encoding="utf-8")).substitute(values)
    path = output_dir / "README.md"
    path.write_text(card, encoding="utf-8")
    logger.info(f"Model card written to {path}")
    return path


def evaluation_results(results: dict, task: str, dataset_names: list[str]) -> list[EvalResult]:
    """The evaluation metrics of all_results.json (`eval_*`, `test_*`) as the Hub's model-index entries."""
    dataset = dataset_names[0] if dataset_names else None
    entries = []
    for name, value in sorted(results.items()):
        split, _, metric = name.partition("_")
        if split not in ("eval", "test") or name.endswith(NOT_METRICS) or not isinstance(value, (int, float)):
            continue
        entries.append(
            EvalResult(
                task_type=task,
                dataset_type=dataset or "local",
                dataset_name=dataset or "local files",
                dataset_split="validation" if split == "eval" else "test",
                metric_type=metric,
                metric_value=value,
            )
        )
    return entries


def base_model_words(finetuned_from: str | None, on_hub: bool) -> str:
    """How the card names the starting model: a Hub id as it is, a local folder by its name only (its path means
    nothing to a reader of the card)."""
    if not finetuned_from:
        return "trained from scratch"
    if on_hub:
        return f"fine-tuned from `{finetuned_from}`"
    return f"fine-tuned from a model trained locally (`{Path(finetuned_from).name}`)"


def markdown_table(header: tuple[str, str], rows) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines.extend(f"| {name} | {value} |" for name, value in rows)
    return "\n".join(lines)


def format_value(value) -> str:
    if isinstance(value, float):
        if math.isfinite(value) and abs(value) >= 1e4:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    return str(value)
