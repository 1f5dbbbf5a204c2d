#!/usr/bin/env python
"""Train a causal RAN language model (`RANForCausalLM` through `AutoModelForCausalLM`), from scratch or from a
checkpoint.

    python scripts/language-modeling/run_clm.py --tokenizer_name outputs/tokenizer \\
        --config_overrides "hidden_size=128,num_attention_heads=4,head_dim=32,window_size=128" \\
        --train_file corpus.jsonl.gz --validation_file ../shared/data/wikitext-2/valid.txt \\
        --do_train --do_eval --output_dir outputs/ran-clm

Every document becomes its tokens followed by one end-of-text token (EOS, or SEP for BERT-style tokenizers), the
documents are concatenated and cut into blocks of `--block_size` tokens, and the labels are the inputs themselves (the
model shifts them). `evaluate_perplexity.py` (in this folder) then reads a long text in one recurrent stream. Hub
data, several machines and resuming work as in `run_mlm.py`.

With `--packing`, every document is an example of its own instead (one longer than `--block_size` cut into
pieces), and a batch's documents are packed into one row without padding (`DataCollatorWithFlattening`), each read
as if it were alone: no document is predicted from the one before it (docs/training.md, "Packed documents").

With `--stream_training`, the training text is read as `--per_device_train_batch_size` parallel streams instead:
each batch row continues the same row of the batch before, and the recurrent state (`RANCache`) is carried from
batch to batch, detached, so backpropagation is truncated at chunk boundaries of `--block_size` tokens. The model
then learns to use what it carried over from arbitrarily far back, with the memory of one chunk (docs/training.md).

The saved folder generates out of the box: its tokenizer adds no special tokens around a prompt and names the
end-of-text token its EOS, and `config.json` and `generation_config.json` carry `eos_token_id` and `pad_token_id`,
so `generate()` and `pipeline("text-generation")` stop at the end of a text.
"""

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, DataCollatorWithFlattening, set_seed


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: training_utils.py, shared by all examples

from checkpoints import prepare_output_dir  # noqa: E402
from data_loading import check_data_limits, describe_source  # noqa: E402
from lm_data import (  # noqa: E402
    cut_documents,
    end_of_text_id,
    group_into_blocks,
    interleave_streams,
    load_text_datasets,
    prepare_for_generation,
    token_ids,
)
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
    block_size: int = field(
        default=1024,
        metadata={
            "at_least": 2,
            "help": "Tokens per training example (per chunk of a stream with --stream_training).",
        },
    )
    stream_training: bool = field(
        default=False,
        metadata={
            "help": "Train on the text as parallel streams (one per batch row), carrying the recurrent state from "
            "chunk to chunk and truncating backpropagation at chunk boundaries. Single process only."
        },
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "One document per example (cut into --block_size pieces where longer), and a batch's documents "
            "packed into one row without padding, each read as if alone (DataCollatorWithFlattening)."
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Processes for tokenization."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many validation blocks."})

    def __post_init__(self):
        if self.dataset_name is None and self.train_file is None and self.validation_file is None:
            raise ValueError("Give --dataset_name or --train_file / --validation_file.")
        if self.packing and self.stream_training:
            raise ValueError(
                "--stream_training reads the text as streams that carry the recurrent state from batch to batch; "
                "--packing reads every document alone. Give one of them."
            )
        check_data_limits(self)


@releases_folder_locks
def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args = parse_arguments(
        (ModelArguments, DataTrainingArguments, RANTrainingArguments), argv
    )
    if model_args.sentence_transformers_pooling is not None:
        raise ValueError("--sentence_transformers_pooling embeds with the bidirectional encoder, not a causal LM.")
    setup_logging(training_args, logger)
    configure_data_parallelism(training_args)
    check_training_length(training_args)
    if data_args.stream_training and training_args.world_size > 1:
        raise ValueError(
            "--stream_training carries each stream's state from batch to batch in one process; it cannot split "
            f"batches over {training_args.world_size} processes. Run it in a single process."
        )
    if data_args.stream_training and training_args.gradient_checkpointing:
        raise ValueError(
            "--stream_training carries each stream's recurrent state (the model's cache) from batch to batch, and a "
            "checkpointed layer, which runs twice, returns none: drop --gradient_checkpointing (a stream chunk's "
            "activations are those of one --block_size) or train without --stream_training."
        )
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
    end_id = end_of_text_id(tokenizer)
    config = load_config(model_args, tokenizer, is_causal=True)
    model = load_model(AutoModelForCausalLM, model_args, config)
    # The saved tokenizer reads a prompt as training reads text (no [CLS]/[SEP] around it), and the saved config and
    # generation config name the end-of-text token as EOS: generate() stops where a document would end.
    prepare_for_generation(model, tokenizer)

    # Preprocessing
    def tokenize(examples):  # in pieces: a long line costs the memory of a piece, not of the line
        return {"input_ids": [np.append(ids, end_id) for ids in token_ids(tokenizer, examples["text"])]}

    with training_args.main_process_first(desc="tokenization"):
        tokenized = raw_datasets.map(
            tokenize,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=["text"],
            desc="Tokenizing",
        )
        lm_datasets = (
            tokenized.with_format("numpy")
            .map(
                cut_documents if data_args.packing else group_into_blocks,
                batched=True,
                fn_kwargs={"block_size": data_args.block_size},
                num_proc=data_args.preprocessing_num_workers,
                desc=f"{'Cutting documents' if data_args.packing else 'Grouping'} into blocks of {data_args.block_size}",
            )
            .with_format(None)
        )
    train_dataset = eval_dataset = None
    if training_args.do_train and data_args.stream_training:
        num_streams = training_args.per_device_train_batch_size
        stream = np.concatenate(list(tokenized["train"].with_format("numpy")["input_ids"])).astype(np.int64)
        train_dataset = interleave_streams(stream, num_streams, data_args.block_size)
        if data_args.max_train_samples is not None:  # whole batches: every stream stops at the same chunk
            kept = min(len(train_dataset), data_args.max_train_samples) // num_streams * num_streams
            if kept == 0:
                raise ValueError(
                    f"--max_train_samples {data_args.max_train_samples} keeps fewer chunks than the {num_streams} "
                    "streams (--per_device_train_batch_size): not one whole batch, so training would run 0 steps and "
                    "save an untrained model. Keep at least one chunk per stream."
                )
            train_dataset = train_dataset.select(range(kept))
        logger.info(f"Stream training: {num_streams} streams of {len(train_dataset) // num_streams:,} chunks each.")
    elif training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    # The adaptive softmax (`cutoffs`) scores each label without building the distribution over the vocabulary, so
    # with labels the model returns no logits: evaluation reports the loss and perplexity, not the accuracy, which
    # needs every id's score. Decided here, before training: nothing may fail after a run has been paid for.
    score_accuracy = training_args.do_eval and getattr(config, "cutoffs", None) is None
    if training_args.do_eval and not score_accuracy:
        logger.warning(
            "The model has an adaptive softmax (config.cutoffs): --do_eval reports eval_loss and perplexity, not "
            "eval_accuracy, which would need the logits of the whole vocabulary (the adaptive softmax never builds "
            "them when scoring labels)."
        )

    def preprocess_logits_for_metrics(logits, labels):
        return logits.argmax(dim=-1)

    def compute_metrics(eval_prediction):
        predictions, labels = eval_prediction
        predictions, labels = predictions[:, :-1], labels[:, 1:]  # the logit at t predicts the token at t + 1
        scored = labels != -100
        return {"accuracy": float((predictions[scored] == labels[scored]).mean())}

    trainer_class, stream_kwargs = RANTrainer, {}
    if data_args.stream_training:
        trainer_class = StreamTrainer
        stream_kwargs = {"chunks_per_stream": len(train_dataset) // training_args.per_device_train_batch_size}
    trainer = trainer_class(
        **stream_kwargs,
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        # labels = input_ids, -100 on padding; packed: -100 at every document's first token
        data_collator=DataCollatorWithFlattening()
        if data_args.packing
        else DataCollatorForLanguageModeling(tokenizer, mlm=False),
        compute_metrics=compute_metrics if score_accuracy else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if score_accuracy else None,
        callbacks=[ParameterChecksumCallback(model_args.parameter_checksum_dir)]
        if model_args.parameter_checksum_dir
        else None,
        card={
            "task": "causal language modelling",
            "pipeline_tag": "text-generation",
            "auto_class": "AutoModelForCausalLM",
            "data": describe_data(data_args, train_dataset, eval_dataset),
            "intended_use": "Next-token prediction and generation over long texts; `generate()` and streaming carry "
            "a recurrent `RANCache` whose size does not grow with the keys and values of past windows.",
            "limitations": "Trained on the text named above only; generations reflect that text and are not "
            "filtered in any way.",
        },
    )
    results = {"output_dir": training_args.output_dir}

    # Training
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
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


class StreamTrainer(RANTrainer):
    """Trains on parallel streams (`interleave_streams`): row r of every training batch continues row r of the batch
    before, so the model's `RANCache` is carried over, detached: truncated backpropagation through time. Evaluation
    reads independent blocks, as `RANTrainer` does."""

    def __init__(self, *args, chunks_per_stream: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunks_per_stream = chunks_per_stream
        self.stream_cache = None
        self.chunks_read = None

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.chunks_read is None:  # a resumed run continues its epoch where the checkpoint left it
            self.chunks_read = self.state.global_step * self.args.gradient_accumulation_steps
        if self.chunks_read % self.chunks_per_stream == 0:
            self.stream_cache = None  # every epoch reads the streams from their beginning
        self.chunks_read += 1
        inputs = {**inputs, "past_key_values": self.stream_cache, "use_cache": True}
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        self.stream_cache = outputs.past_key_values.detach()
        return (loss, outputs) if return_outputs else loss


def describe_data(data_args: DataTrainingArguments, train_dataset, eval_dataset) -> str:
    source = describe_source(data_args)
    parts = []
    if train_dataset is not None and data_args.stream_training:
        parts.append(f"{len(train_dataset):,} training chunks read as parallel streams (truncated backpropagation)")
    elif train_dataset is not None:
        parts.append(f"{len(train_dataset):,} training blocks")
    if eval_dataset is not None:
        parts.append(f"{len(eval_dataset):,} validation blocks")
    if data_args.packing:
        return (
            f"{source}; documents ended by an end-of-text token, each an example of its own (cut into "
            f"{data_args.block_size}-token pieces where longer), a batch's documents packed into one row and each "
            f"read alone ({', '.join(parts)})."
        )
    return (
        f"{source}; documents ended by an end-of-text token, concatenated and cut into {data_args.block_size}-token "
        f"pieces ({', '.join(parts)})."
    )


if __name__ == "__main__":
    main()
