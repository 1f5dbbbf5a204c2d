#!/usr/bin/env python
"""Train a RAN to write a short target from a long source (summarisation-style) and score it with ROUGE.

    python scripts/summarization/run_summarization.py --model_kind prefix --tokenizer_name outputs/tokenizer \\
        --config_overrides "hidden_size=128,num_attention_heads=4,head_dim=32,window_size=128" \\
        --train_file ../shared/data/eurlex57k/train.jsonl.gz --validation_file ../shared/data/eurlex57k/dev.jsonl.gz \\
        --title_from_first_line --max_source_length 512 --max_target_length 48 \\
        --do_train --do_eval --output_dir outputs/ran-eurlex-titles

Each example is one text: the source (`[CLS] source [SEP]`), then the target's tokens and `[SEP]`; labels are the
target's tokens, -100 over the source. `--model_kind` picks the model that reads it:

* `prefix`: `RANForPrefixLM` (`AutoModelForSeq2SeqLM`), rannet's sequence-to-sequence RAN: the source is read both
  ways, the target causally (docs/seq2seq.md);
* `causal`: `RANForCausalLM` (`AutoModelForCausalLM`) reading the same `source [SEP] target [SEP]` left to right;
* `gpt2`: the baseline, a GPT-2 of the same width, depth and heads (`--config_overrides` names them as RAN fields),
  trained from scratch on the same text with a context of `max_source_length + max_target_length` positions and,
  like the causal RAN, an LM head untied from the embedding.

With `--title_from_first_line` the target is a text's first line and the source the rest (EURLEX-57K: an act's
title, then its body); otherwise `--summary_column` names the target. Evaluation generates a target for every
validation example (greedy, or `--num_beams`) and reports ROUGE-1, ROUGE-2 and ROUGE-L F1 (the `rouge-score`
package, stemmed), with the loss, and writes the generations to `generations.jsonl`.
"""

import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    DataCollatorForSeq2Seq,
    GPT2Config,
    GPT2LMHeadModel,
    set_seed,
)


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: training_utils.py, shared by all examples

from checkpoints import prepare_output_dir  # noqa: E402
from ran_trainer import RANTrainer  # noqa: E402
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

from ran_hf import prefix_lm_features  # noqa: E402
from ran_hf.files.data import iter_records  # noqa: E402
from ran_hf.files.folder_locks import releases_folder_locks  # noqa: E402


logger = logging.getLogger(__name__)

MODEL_KINDS = ("prefix", "causal", "gpt2")


@dataclass
class DataTrainingArguments:
    model_kind: str = field(
        default="prefix",
        metadata={
            "help": "prefix: RANForPrefixLM; causal: RANForCausalLM on `source [SEP] target`; gpt2: a GPT-2 of the "
            "same size on the same text (the baseline)."
        },
    )
    train_file: str | None = field(default=None, metadata={"help": "Training data: .jsonl or .jsonl.gz."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same format."})
    text_column: str = field(default="text", metadata={"help": "Column holding the source text."})
    summary_column: str | None = field(default=None, metadata={"help": "Column holding the target text."})
    title_from_first_line: bool = field(
        default=False, metadata={"help": "The target is the text's first line, the source the rest (EURLEX-57K)."}
    )
    # At least 3: a special token on each side of at least one token of text.
    max_source_length: int = field(
        default=512, metadata={"at_least": 3, "help": "Source tokens kept, [CLS] and [SEP] included."}
    )
    max_target_length: int = field(
        default=64, metadata={"at_least": 3, "help": "Target tokens kept, the final [SEP] included."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Keep only this many training examples."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Keep only this many validation examples."}
    )
    num_beams: int = field(
        default=1, metadata={"at_least": 1, "help": "Beams when generating for evaluation (1: greedy)."}
    )

    def __post_init__(self):
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"--model_kind must be one of {MODEL_KINDS}, got {self.model_kind!r}.")
        if self.train_file is None and self.validation_file is None:
            raise ValueError("Give --train_file and/or --validation_file.")
        if self.title_from_first_line == (self.summary_column is not None):
            raise ValueError("Give exactly one of --title_from_first_line and --summary_column.")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name} {path}: no such file.")
            if path is not None and not path.endswith((".jsonl", ".jsonl.gz")):
                raise ValueError(f"--{name} {path}: expected a .jsonl or .jsonl.gz file.")


def read_pairs(path: str, data_args: DataTrainingArguments, limit: int | None) -> list[tuple[str, str]]:
    """(source, target) pairs of a jsonl(.gz) file, read record by record (`ran_hf.files.data.iter_records`: a JSON
    array, a broken line, a null, blank or non-text field, a lone surrogate are errors naming the file and line) until
    `limit` pairs are kept. A record whose source or target is blank once split (a title without a body) is skipped
    and counted in the log."""
    column = data_args.text_column if data_args.title_from_first_line else data_args.summary_column
    columns = list(dict.fromkeys([data_args.text_column, column]))
    pairs, skipped = [], 0
    for number, record in enumerate(iter_records(path, text_columns=columns), 1):
        if limit is not None and len(pairs) >= limit:
            break
        missing = [name for name in columns if name not in record]
        if missing:
            raise ValueError(f"{path}, record {number}: no text field {missing[0]!r} (it has {sorted(record)}).")
        if data_args.title_from_first_line:
            target, _, source = record[data_args.text_column].strip().partition("\n")
        else:
            source, target = record[data_args.text_column], record[data_args.summary_column]
        if source.strip() and target.strip():
            pairs.append((source.strip(), target.strip()))
        else:
            skipped += 1
    if skipped:
        logger.warning(f"{path}: skipped {skipped:,} records whose source or target is blank; {len(pairs):,} kept.")
    if not pairs:
        raise ValueError(f"{path}: no (source, target) pair found.")
    return pairs


def rouge(predictions: list[str], references: list[str]) -> dict:
    """ROUGE-1, -2 and -L F1 (x 100), averaged over examples, as Transformers' summarisation example reports them."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as error:
        raise ImportError("ROUGE needs the `rouge-score` package: pip install rouge-score") from error
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = [scorer.score(reference, prediction) for prediction, reference in zip(predictions, references)]
    return {name: 100 * sum(score[name].fmeasure for score in scores) / len(scores) for name in scores[0]}


@torch.no_grad()
def generate_targets(model, tokenizer, sources: list[str], data_args, batch_size: int) -> list[str]:
    """Greedy (or beam) targets for `sources`, `batch_size` at a time; RAN ignores padding, on either side."""
    model.eval()
    predictions = []
    for start in range(0, len(sources), batch_size):
        encoded = [
            prefix_lm_features(tokenizer, source, max_source_length=data_args.max_source_length)
            for source in sources[start : start + batch_size]
        ]
        features = [{"input_ids": example["input_ids"]} for example in encoded]  # the source alone, no segments
        batch = tokenizer.pad(features, padding_side="left", return_tensors="pt").to(model.device)
        output = model.generate(
            **batch,
            max_new_tokens=data_args.max_target_length,
            num_beams=data_args.num_beams,
            do_sample=False,
            eos_token_id=tokenizer.sep_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        predictions += [text.strip() for text in tokenizer.batch_decode(output, skip_special_tokens=True)]
    return predictions


def gpt2_like(config, context: int) -> GPT2LMHeadModel:
    """A new GPT-2 with the RAN config's width, depth, heads, dropout and vocabulary: the baseline. Its context holds
    the whole example (a GPT-2 cannot read past it; RAN has no such limit)."""
    gpt2_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=context,
        n_embd=config.hidden_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        resid_pdrop=config.hidden_dropout_prob,
        embd_pdrop=config.hidden_dropout_prob,
        attn_pdrop=config.attention_probs_dropout_prob,
        bos_token_id=config.eos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        tie_word_embeddings=False,  # as the causal RAN's default
    )
    return GPT2LMHeadModel(gpt2_config)


@releases_folder_locks
def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args = parse_arguments(
        (ModelArguments, DataTrainingArguments, RANTrainingArguments), argv
    )
    setup_logging(training_args, logger)
    configure_data_parallelism(training_args)
    check_training_length(training_args)
    if training_args.do_train and data_args.train_file is None:
        raise ValueError("--do_train needs --train_file.")
    if training_args.do_eval and data_args.validation_file is None:
        raise ValueError("--do_eval needs --validation_file.")
    if data_args.model_kind == "gpt2" and model_args.model_name_or_path is not None:
        raise ValueError("--model_kind gpt2 trains the baseline from scratch: give no --model_name_or_path.")
    checkpoint = prepare_output_dir(training_args, model_args, data_args)
    set_seed(training_args.seed)

    tokenizer = load_tokenizer(model_args)
    if tokenizer.sep_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer needs a `sep_token` (end of source and of target) and a `pad_token`.")
    causal = data_args.model_kind != "prefix"
    config = load_config(model_args, tokenizer, is_causal=causal)
    config.eos_token_id = tokenizer.sep_token_id
    if data_args.model_kind == "gpt2":
        model = gpt2_like(config, data_args.max_source_length + data_args.max_target_length)
    else:
        model = load_model(AutoModelForCausalLM if causal else AutoModelForSeq2SeqLM, model_args, config)
    logger.info(f"{type(model).__name__}: {model.num_parameters():,} parameters")
    model.generation_config.eos_token_id = tokenizer.sep_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    def features(pairs):
        examples = []
        for source, target in pairs:
            example = prefix_lm_features(
                tokenizer, source, target, data_args.max_source_length, data_args.max_target_length
            )
            if causal:  # the same text, read left to right: no segments
                del example["token_type_ids"]
            examples.append(example)
        return examples

    train_pairs = eval_pairs = None
    if training_args.do_train:
        train_pairs = read_pairs(data_args.train_file, data_args, data_args.max_train_samples)
    if training_args.do_eval:
        eval_pairs = read_pairs(data_args.validation_file, data_args, data_args.max_eval_samples)
    trainer = RANTrainer(
        model=model,
        args=training_args,
        train_dataset=features(train_pairs) if train_pairs else None,
        eval_dataset=features(eval_pairs) if eval_pairs else None,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer),  # pads labels with -100, token_type_ids with 0
        card={
            "task": "summarisation-style generation (a short target from a long source)",
            "pipeline_tag": "text-generation",
            "auto_class": "AutoModelForCausalLM" if causal else "AutoModelForSeq2SeqLM",
            "data": f"{data_args.train_file}: {len(train_pairs or []):,} (source, target) pairs",
            "intended_use": "Generating a short target (a title, a summary) after its source; see docs/seq2seq.md.",
            "limitations": "Trained on the data named above only.",
        },
    )
    results = {"output_dir": training_args.output_dir, "model_kind": data_args.model_kind}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = {
            **train_result.metrics,
            "train_samples": len(train_pairs),
            "model_parameters": model.num_parameters(),
        }
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        results["train"] = metrics
    if training_args.do_eval:
        metrics = trainer.evaluate()
        sources, references = zip(*eval_pairs)
        predictions = generate_targets(
            model, tokenizer, list(sources), data_args, training_args.per_device_eval_batch_size
        )
        metrics.update({f"eval_{name}": value for name, value in rouge(predictions, list(references)).items()})
        metrics["eval_samples"] = len(eval_pairs)
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else math.inf
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        with open(Path(training_args.output_dir) / "generations.jsonl", "w", encoding="utf-8") as out:
            out.writelines(
                json.dumps({"prediction": prediction, "reference": reference}) + "\n"
                for prediction, reference in zip(predictions, references)
            )
        results["eval"] = metrics
    if training_args.push_to_hub:
        trainer.push_to_hub(finetuned_from=model_args.model_name_or_path)
    elif training_args.do_train:
        trainer.create_model_card(finetuned_from=model_args.model_name_or_path)
    return results


if __name__ == "__main__":
    main()
