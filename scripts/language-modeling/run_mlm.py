#!/usr/bin/env python
"""Pretrain a RAN with masked language modelling, from scratch or continuing from a checkpoint.

From scratch, with a tokenizer made by `scripts/train_tokenizer.py`:

    python scripts/language-modeling/run_mlm.py --tokenizer_name outputs/tokenizer \\
        --config_overrides "hidden_size=128,num_attention_heads=4,head_dim=32,window_size=128" \\
        --train_file corpus.jsonl.gz --validation_file valid.txt \\
        --do_train --do_eval --output_dir outputs/ran-mlm

Continued pretraining: `--model_name_or_path outputs/ran-mlm` (or a Hub id) instead of the tokenizer and overrides.
Hub data: `--dataset_name wikitext --dataset_config_name wikitext-103-raw-v1`. Several machines: the same command under
`torchrun --nproc_per_node N` or `accelerate launch`.

Documents are tokenized with the tokenizer's special tokens (`[CLS] text [SEP]` for those of `train_tokenizer.py`),
concatenated and cut into blocks of `--max_seq_length` tokens (RAN has no position limit, so blocks may be long);
`--line_by_line` keeps one document per example instead, and `--packing` too, with a batch's documents packed into one
row without padding, each read as if it were alone (docs/training.md, "Packed documents"). Masking is dynamic: `DataCollatorForLanguageModeling` draws
new masks every time a batch is formed. Evaluation reports the masked-token loss, its exponential (`perplexity`) and
the accuracy on masked tokens. `--resume_from_checkpoint latest` restores weights, optimizer, scheduler, step and data
order exactly, but the masks drawn after the resume differ from an uninterrupted run's (see docs/training.md).
"""

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling, set_seed


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: training_utils.py, shared by all examples

from checkpoints import prepare_output_dir  # noqa: E402
from data_loading import check_data_limits, cut_for_tokenizer, describe_source  # noqa: E402
from lm_data import PackedMaskedLMCollator, group_into_blocks, load_text_datasets, token_ids  # noqa: E402
from ran_trainer import ParameterChecksumCallback, RANTrainer  # noqa: E402
from training_utils import (  # noqa: E402
    ModelArguments,
    RANTrainingArguments,
    check_training_length,
    configure_data_parallelism,
    load_config,
    load_model,
    load_tokenizer,
    parse_arguments,
    setup_logging,
)

from ran_hf.files.folder_locks import releases_folder_locks  # noqa: E402


logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset to train on (`datasets` name)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the Hub dataset."})
    train_file: str | None = field(
        default=None, metadata={"help": "Training text: .txt (one document per line), .jsonl(.gz) or .csv."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Validation text, same formats."})
    text_column_name: str = field(
        default="text", metadata={"help": "Column holding the text in jsonl / csv / Hub data."}
    )
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percentage of training documents held out when there is no validation split."}
    )
    max_seq_length: int = field(default=1024, metadata={"at_least": 2, "help": "Tokens per training example (block)."})
    line_by_line: bool = field(
        default=False, metadata={"help": "One document per example (truncated to max_seq_length), no concatenation."}
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "One document per example (as --line_by_line), and a batch's documents packed into one row "
            "without padding, each read as if alone (DataCollatorWithFlattening's position_ids)."
        },
    )
    mlm_probability: float = field(default=0.15, metadata={"above": 0, "below": 1, "help": "Share of tokens to mask."})
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Pad batches to a multiple of this length."}
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Processes for tokenization."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many validation examples."})

    def __post_init__(self):
        if self.dataset_name is None and self.train_file is None and self.validation_file is None:
            raise ValueError("Give --dataset_name or --train_file / --validation_file.")
        if self.packing and self.pad_to_multiple_of is not None:
            raise ValueError(
                "--pad_to_multiple_of pads a batch's rows, but --packing puts a batch's documents in one row without "
                "padding. Give one of them."
            )
        check_data_limits(self)


@releases_folder_locks
def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args = parse_arguments(
        (ModelArguments, DataTrainingArguments, RANTrainingArguments), argv
    )
    setup_logging(training_args, logger)
    configure_data_parallelism(training_args)
    check_training_length(training_args)
    # refuses to train over a previous run unasked or over its own inputs; locks the folder for the run
    checkpoint = prepare_output_dir(training_args, model_args, data_args)
    set_seed(training_args.seed)

    # Data
    raw_datasets = load_text_datasets(model_args, data_args)
    if training_args.do_train and "train" not in raw_datasets:
        raise ValueError("--do_train needs a training split (--train_file or a Hub dataset with one).")
    if training_args.do_eval and "validation" not in raw_datasets:
        raise ValueError("--do_eval needs a validation split (--validation_file or --validation_split_percentage).")

    # Tokenizer, config and model
    tokenizer = load_tokenizer(model_args)
    if tokenizer.mask_token_id is None:
        raise ValueError("Masked language modelling needs a tokenizer with a mask token.")
    config = load_config(model_args, tokenizer)
    model = load_model(AutoModelForMaskedLM, model_args, config)

    # Preprocessing
    def tokenize(examples):
        texts = examples["text"]
        if not (
            data_args.line_by_line or data_args.packing
        ):  # in pieces: a long line costs the memory of a piece, not of the line
            return {"input_ids": token_ids(tokenizer, texts, special_tokens=True)}
        # truncated: cut long documents first, to tokenize only what is kept
        texts = cut_for_tokenizer(tokenizer, texts, data_args.max_seq_length)
        return tokenizer(texts, truncation=True, max_length=data_args.max_seq_length, return_attention_mask=False)

    with training_args.main_process_first(desc="tokenization"):
        tokenized = raw_datasets.map(
            tokenize,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=["text"],
            desc="Tokenizing",
        )
        if not (data_args.line_by_line or data_args.packing):
            tokenized = (
                tokenized.with_format("numpy")
                .map(
                    group_into_blocks,
                    batched=True,
                    fn_kwargs={"block_size": data_args.max_seq_length},
                    num_proc=data_args.preprocessing_num_workers,
                    desc=f"Grouping into blocks of {data_args.max_seq_length}",
                )
                .with_format(None)
            )
    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = tokenized["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = tokenized["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    def preprocess_logits_for_metrics(logits, labels):
        return logits.argmax(dim=-1)  # keep predictions, not (tokens x vocabulary) logits, across evaluation

    def compute_metrics(eval_prediction):
        predictions, labels = eval_prediction
        masked = labels != -100
        return {"accuracy": float((predictions[masked] == labels[masked]).mean())}

    collator = DataCollatorForLanguageModeling(
        tokenizer, mlm_probability=data_args.mlm_probability, pad_to_multiple_of=data_args.pad_to_multiple_of
    )
    if data_args.packing:
        collator = PackedMaskedLMCollator(collator)
    trainer = RANTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
        callbacks=[ParameterChecksumCallback(model_args.parameter_checksum_dir)]
        if model_args.parameter_checksum_dir
        else None,
        sentence_transformers_pooling=model_args.sentence_transformers_pooling,
        card={
            "task": "masked language modelling",
            "pipeline_tag": "fill-mask",
            "auto_class": "AutoModelForMaskedLM",
            "data": describe_data(data_args, train_dataset, eval_dataset),
            "intended_use": "A pretrained encoder to fine-tune on long-document tasks with "
            "`scripts/text-classification/run_classification.py` or `scripts/token-classification/run_ner.py`, or "
            "to fill masked tokens.",
            "limitations": "Pretrained on the text named above only; its vocabulary and knowledge are those of "
            "that text.",
        },
    )
    results = {"output_dir": training_args.output_dir}

    # Training
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # the model, its code and the tokenizer
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics

    # Evaluation
    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else math.inf
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics

    card_kwargs = {"finetuned_from": model_args.model_name_or_path, "dataset": data_args.dataset_name}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card_kwargs)
    elif training_args.do_train:
        trainer.create_model_card(**card_kwargs)
    return results


def describe_data(data_args: DataTrainingArguments, train_dataset, eval_dataset) -> str:
    source = describe_source(data_args)
    layout = (
        f"one document per example, truncated to {data_args.max_seq_length} tokens"
        if data_args.line_by_line or data_args.packing
        else f"documents concatenated into blocks of {data_args.max_seq_length} tokens"
    )
    if data_args.packing:
        layout += ", a batch's documents packed into one row, each read alone"
    counts = ", ".join(
        f"{len(dataset):,} {name} examples"
        for name, dataset in (("training", train_dataset), ("validation", eval_dataset))
        if dataset is not None
    )
    return f"{source}; {layout} ({counts}); {data_args.mlm_probability:.0%} of tokens masked, redrawn every batch."


if __name__ == "__main__":
    main()
