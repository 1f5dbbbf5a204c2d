#!/usr/bin/env python
"""Fine-tune and evaluate a RAN on named-entity recognition (token classification), scored with seqeval.

    python scripts/token-classification/run_ner.py --model_name_or_path outputs/ran-mlm \\
        --train_file ../shared/data/conll2003/train.txt \\
        --validation_file ../shared/data/conll2003/valid.txt \\
        --test_file ../shared/data/conll2003/test.txt \\
        --do_train --do_eval --do_predict --output_dir outputs/ran-conll2003

Data: CoNLL files (one token per line, token first and tag last, blank lines between sentences, `-DOCSTART-` ignored;
every line must have the same number of columns), jsonl files with `--tokens_column_name` and `--tags_column_name`
lists, or a Hub dataset (`--dataset_name conll2003`, whose `ner_tags` are `ClassLabel` ids). Words are split into
subwords by a fast tokenizer; the first subword of a word carries its tag and the others are ignored in the loss (or,
with `--label_all_tokens`, carry the tag too, B- turned into I-).

Metrics: entity-level precision, recall and F1 (micro-averaged over entity types, conlleval rules) and token
accuracy, from `evaluate.load("seqeval")` when it can be loaded, else from the `seqeval` package directly (the same
functions; `evaluate` fetches its metric scripts from the Hub, which offline machines cannot reach).
"""

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import evaluate
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value
from transformers import (
    AutoModelForTokenClassification,
    DataCollatorForTokenClassification,
    set_seed,
)

from ran_hf.files.data import check_text, file_format, jsonl_line, load_records, read_conll
from ran_hf.files.labels import TagLabels, UnknownLabelsError


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: training_utils.py, shared by all examples

from checkpoints import prepare_output_dir  # noqa: E402
from data_loading import check_data_limits, describe_source, first_examples, load_splits  # noqa: E402
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
    trained_labels,
)

from ran_hf.files.folder_locks import releases_folder_locks  # noqa: E402


logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset (`datasets` name), e.g. conll2003."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the Hub dataset."})
    train_file: str | None = field(default=None, metadata={"help": "Training sentences: CoNLL file or jsonl(.gz)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation sentences, same formats."})
    test_file: str | None = field(default=None, metadata={"help": "Test sentences, same formats."})
    tokens_column_name: str = field(default="tokens", metadata={"help": "Column with the list of words (jsonl, Hub)."})
    tags_column_name: str = field(default="ner_tags", metadata={"help": "Column with the list of tags (jsonl, Hub)."})
    max_seq_length: int = field(default=512, metadata={"help": "Sentences are truncated to this many subword tokens."})
    label_all_tokens: bool = field(
        default=False, metadata={"help": "Give every subword its word's tag, instead of the first one only."}
    )
    return_entity_level_metrics: bool = field(
        default=False, metadata={"help": "Also report precision, recall and F1 of every entity type."}
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Processes for tokenization."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training sentences."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation sentences."}
    )
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep only the first N test sentences."})

    def __post_init__(self):
        if self.dataset_name is None and not (self.train_file or self.validation_file or self.test_file):
            raise ValueError("Give --dataset_name or --train_file / --validation_file / --test_file.")
        if self.max_seq_length < 2:
            raise ValueError(
                f"--max_seq_length must be at least 2 (room for a word and a special token), got "
                f"{self.max_seq_length}."
            )
        check_data_limits(self)


@dataclass(frozen=True)
class SentenceFile:
    """A split's file, to name a sentence by its place in it: the line of a CoNLL sentence's first token (`lines`,
    read with the file), or that of a jsonl record (found only when an error names it, by reading the file again).
    Kept beside the split, not in it: the Trainer sees only the sentences' columns."""

    path: str
    lines: tuple[int, ...] | None = None

    def place(self, index: int) -> str:
        line = self.lines[index] if self.lines is not None else jsonl_line(self.path, index)
        return f"{self.path}:{line}"


def sentence_place(split: str, index: int, source: SentenceFile | None) -> str:
    """Sentence `index` (0-based) of `split`: `path:line (train sentence 57)` for a file, else its number."""
    sentence = f"{split} sentence {index + 1}"
    return sentence if source is None else f"{source.place(index)} ({sentence})"


def choose_tags(
    splits: dict[str, list], model_args: ModelArguments, sources: dict[str, SentenceFile] | None = None
) -> TagLabels:
    """The tags, in the order of the model's outputs.

    A trained tagger (`--model_name_or_path` with named tags in its `id2label`) keeps its own: the data's tags are
    mapped onto them, tags it lacks are an error, and a split may use only some of them. Otherwise, as with
    `--ignore_mismatched_sizes` and another number of tags (a new head), they are read off the data. An unknown tag
    is named with the first sentence holding it, by its file and line where `sources` has the split's file.
    """
    sources = sources or {}

    def where(split: str, index: int) -> str:
        return sentence_place(split, index, sources.get(split))

    trained = trained_labels(model_args)
    if trained is None:
        return TagLabels.from_splits(splits, where=where)
    names, _ = trained
    model = model_args.config_name or model_args.model_name_or_path
    if model_args.ignore_mismatched_sizes:
        from_data = TagLabels.from_splits(splits, where=where)
        if len(from_data.names) != len(names):
            logger.warning(
                f"--ignore_mismatched_sizes: the head of {model} for its {len(names)} tags is replaced by a new one "
                f"for the data's {len(from_data.names)}."
            )
            return from_data
    try:
        return TagLabels.from_splits(splits, names=names, names_from=f"the model {model}", where=where)
    except UnknownLabelsError as error:
        raise UnknownLabelsError(
            f"{error} Check --tags_column_name; to train a new head for the data's tags, start from a model without "
            "one (run_mlm.py's, say), or pass --ignore_mismatched_sizes when their number differs."
        ) from None


def warn_about_cut_words(split: str, dataset: Dataset, max_seq_length: int) -> None:
    """Say how many words, and entity words, `--max_seq_length` cut off (the scores leave them out too)."""
    cut_words = dataset["cut_words"]
    cut_sentences = sum(count > 0 for count in cut_words)
    if not cut_sentences:
        return
    logger.warning(
        f"{split}: --max_seq_length {max_seq_length} cut {cut_sentences:,} of {len(dataset):,} sentences short: "
        f"{sum(cut_words):,} words, {sum(dataset['cut_entity_words']):,} of them tagged as entities (not 'O'), are "
        f"neither trained on nor scored (nor predicted: predictions.txt gives them 'O'). Raise --max_seq_length "
        "to keep them."
    )


def load_sentences(
    model_args: ModelArguments, data_args: DataTrainingArguments
) -> tuple[DatasetDict, dict[str, SentenceFile]]:
    """Every split whole, with columns "tokens" and "ner_tags" (tag names, not ids), from the Hub, jsonl or CoNLL
    files, and the file of each split read from one (for errors that name a sentence by its file and line). Every
    sentence is checked (`check_sentences`), not only those --max_*_samples keeps: the tags of whole splits make the
    tag set."""
    tokens_column, tags_column = data_args.tokens_column_name, data_args.tags_column_name
    flags = {tokens_column: "--tokens_column_name", tags_column: "--tags_column_name"}  # named for a missing column
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    sources = {}
    if data_args.dataset_name is not None:
        splits = load_splits(
            data_args.dataset_name,
            data_args.dataset_config_name,
            {},
            [tokens_column, tags_column],
            cache_dir=model_args.cache_dir,
            token=model_args.token,
            flags=flags,
        )
    else:
        splits = DatasetDict()
        for split, path in files.items():
            if path is None:
                continue
            if file_format(path) == "jsonl":
                columns = [tokens_column, tags_column]
                splits[split] = load_records(path, columns, cache_dir=model_args.cache_dir, flags=flags)
                sources[split] = SentenceFile(str(path))
            else:
                conll = read_conll(path, with_lines=True)
                lines = tuple(sentence.pop("line") for sentence in conll)  # beside the data, not a column of it
                columns = {"tokens": tokens_column, "ner_tags": tags_column}
                splits[split] = Dataset.from_list(conll).rename_columns(columns)
                sources[split] = SentenceFile(str(path), lines)
    sentences = DatasetDict()
    for split, dataset in splits.items():
        dataset = dataset.select_columns([tokens_column, tags_column])
        feature = dataset.features[tags_column]
        if isinstance(feature, List) and isinstance(feature.feature, ClassLabel):  # Hub data: ids of named tags
            names = feature.feature
            dataset = dataset.map(
                lambda batch, names=names: {tags_column: [names.int2str(row) for row in batch[tags_column]]},
                batched=True,
                features=Features({**dataset.features, tags_column: List(Value("string"))}),
                desc=f"Tag names of {split}",
            )
        dataset = dataset.rename_columns({tokens_column: "tokens", tags_column: "ner_tags"})
        dataset.map(
            check_sentences,
            batched=True,
            with_indices=True,
            fn_kwargs={
                "split": split,
                "tokens_column": tokens_column,
                "tags_column": tags_column,
                "source": sources.get(split),
            },
            desc=f"Checking the sentences of {split}",
        )
        sentences[split] = dataset
    return sentences, sources


def check_sentences(
    batch: dict,
    indices: list[int],
    split: str,
    tokens_column: str,
    tags_column: str,
    source: SentenceFile | None = None,
) -> None:
    """Words and tags are non-empty lists of the same length, of non-blank strings: tag names, not ids (a batched map,
    naming the split and the sentence, and, read from a file, its file and line first)."""
    for index, words, tags in zip(indices, batch["tokens"], batch["ner_tags"]):
        where = f"{split} sentence {index + 1}"
        try:
            check_sentence(words, tags, where, tokens_column, tags_column)
        except ValueError as error:  # each message starts with `where`; a jsonl line is looked up only here
            if source is None:
                raise
            raise ValueError(sentence_place(split, index, source) + str(error).removeprefix(where)) from None


def check_sentence(words, tags, where: str, tokens_column: str, tags_column: str) -> None:
    """One sentence's checks (`check_sentences`): every error message starts with `where`."""
    for column, values in ((tokens_column, words), (tags_column, tags)):
        if not isinstance(values, list | tuple) or not values:
            raise ValueError(f"{where}: column {column!r} must be a non-empty list, got {values!r}.")
        for value in values:
            if column == tags_column and isinstance(value, int) and not isinstance(value, bool):
                raise ValueError(
                    f"{where}: column {column!r} holds tag ids ({values!r}); a jsonl file must give tag names "
                    "(B-PER, I-PER, O, ...), since ids alone do not say which tag they are."
                )
            check_text(value, where, column)
    if len(words) != len(tags):
        raise ValueError(f"{where} has {len(words)} tokens but {len(tags)} tags.")


def load_seqeval():
    """`compute(predictions=, references=)` of seqeval: through `evaluate` if it loads, else the package itself."""
    try:
        return evaluate.load("seqeval").compute
    except Exception as error:  # noqa: BLE001  (evaluate fetches metric scripts from the Hub: offline it cannot)
        logger.warning(
            f"evaluate.load('seqeval') failed ({type(error).__name__}); computing with the seqeval package."
        )
    from seqeval.metrics import accuracy_score, classification_report

    def compute(predictions, references):
        report = classification_report(references, predictions, output_dict=True, zero_division=0)
        results = {
            name: {
                "precision": scores["precision"],
                "recall": scores["recall"],
                "f1": scores["f1-score"],
                "number": scores["support"],
            }
            for name, scores in report.items()
            if name not in ("micro avg", "macro avg", "weighted avg")
        }
        overall = report["micro avg"]
        results.update(
            overall_precision=overall["precision"],
            overall_recall=overall["recall"],
            overall_f1=overall["f1-score"],
            overall_accuracy=accuracy_score(references, predictions),
        )
        return results

    return compute


def align_tags(word_ids: list[int | None], tag_ids: list[int], inside_of: dict[int, int], label_all_tokens: bool):
    """Per-token labels from per-word tag ids: the first subword of a word gets its tag, special tokens -100, and
    later subwords -100 (with `label_all_tokens`, the tag too, a B- tag turned into its I- tag via `inside_of`)."""
    labels, previous_word = [], None
    for word in word_ids:
        if word is None:
            labels.append(-100)
        elif word != previous_word:
            labels.append(tag_ids[word])
        else:
            labels.append(inside_of.get(tag_ids[word], tag_ids[word]) if label_all_tokens else -100)
        previous_word = word
    return labels


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
    raw_datasets, sources = load_sentences(model_args, data_args)
    for split, needed in (
        ("train", training_args.do_train),
        ("validation", training_args.do_eval),
        ("test", training_args.do_predict),
    ):
        if needed and split not in raw_datasets:
            raise ValueError(
                f"The {split} split is needed (--do_{'eval' if split == 'validation' else split}) but missing."
            )
    # The tags of whole splits (a run with --max_*_samples has the tags of a full run), then the first sentences
    tags = choose_tags({split: dataset["ner_tags"][:] for split, dataset in raw_datasets.items()}, model_args, sources)
    logger.info(f"{len(tags.names)} tags: {list(tags.names)}")
    limits = {
        "train": data_args.max_train_samples,
        "validation": data_args.max_eval_samples,
        "test": data_args.max_predict_samples,
    }
    raw_datasets = first_examples(raw_datasets, limits)

    # Tokenizer, config and model
    tokenizer = load_tokenizer(model_args)
    if not tokenizer.is_fast:
        raise ValueError("Aligning tags with subwords needs a fast tokenizer (one with `word_ids()`).")
    config = load_config(
        model_args,
        tokenizer,
        num_labels=len(tags.names),
        id2label=dict(enumerate(tags.names)),
        label2id=tags.label2id,
        finetuning_task="ner",
    )
    model = load_model(AutoModelForTokenClassification, model_args, config)

    # Preprocessing: subword tokens, with the word's tag on its first subword (or all of them) and -100 elsewhere
    label2id = tags.label2id
    inside_of = {
        label2id[name]: label2id.get("I-" + name[2:], label2id[name]) for name in tags.names if name.startswith("B-")
    }

    def tokenize_and_align(examples):
        encoded = tokenizer(
            examples["tokens"], is_split_into_words=True, truncation=True, max_length=data_args.max_seq_length
        )
        encoded["labels"] = [
            align_tags(
                encoded.word_ids(row), [label2id[tag] for tag in sentence_tags], inside_of, data_args.label_all_tokens
            )
            for row, sentence_tags in enumerate(examples["ner_tags"])
        ]
        # Words past --max_seq_length are neither trained on nor scored: counted, to say so.
        kept = [
            1 + max((word for word in encoded.word_ids(row) if word is not None), default=-1)
            for row in range(len(examples["ner_tags"]))
        ]
        encoded["cut_words"] = [len(sentence) - count for sentence, count in zip(examples["ner_tags"], kept)]
        encoded["cut_entity_words"] = [
            sum(tag != "O" for tag in sentence[count:]) for sentence, count in zip(examples["ner_tags"], kept)
        ]
        return encoded

    with training_args.main_process_first(desc="tokenization"):
        processed = raw_datasets.map(
            tokenize_and_align,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=["tokens", "ner_tags"],
            desc="Tokenizing and aligning tags",
        )
    for split, dataset in processed.items():
        warn_about_cut_words(split, dataset, data_args.max_seq_length)
    processed = processed.remove_columns(["cut_words", "cut_entity_words"])
    train_dataset = processed.get("train") if training_args.do_train else None
    eval_dataset = processed.get("validation") if training_args.do_eval else None
    predict_dataset = processed.get("test") if training_args.do_predict else None

    seqeval = load_seqeval()

    def tag_sequences(predictions, gold):
        """Tag names at the scored positions (first subwords), per sentence."""
        predicted, reference = [], []
        for prediction_row, gold_row in zip(predictions, gold):
            scored = gold_row != -100
            predicted.append([tags.names[i] for i in prediction_row[scored]])
            reference.append([tags.names[i] for i in gold_row[scored]])
        return predicted, reference

    def compute_metrics(eval_prediction):
        logits, gold = eval_prediction
        predicted, reference = tag_sequences(logits.argmax(-1), gold)
        results = seqeval(predictions=predicted, references=reference)
        metrics = {
            "precision": results["overall_precision"],
            "recall": results["overall_recall"],
            "f1": results["overall_f1"],
            "accuracy": results["overall_accuracy"],
        }
        if data_args.return_entity_level_metrics:
            for entity, scores in results.items():
                if isinstance(scores, dict):
                    metrics.update({f"{entity}_{name}": value for name, value in scores.items()})
        return metrics

    trainer = RANTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForTokenClassification(tokenizer),
        compute_metrics=compute_metrics,
        callbacks=[ParameterChecksumCallback(model_args.parameter_checksum_dir)]
        if model_args.parameter_checksum_dir
        else None,
        sentence_transformers_pooling=model_args.sentence_transformers_pooling,
        card={
            "task": f"named-entity recognition ({len(tags.names)} IOB tags)",
            "pipeline_tag": "token-classification",
            "auto_class": "AutoModelForTokenClassification",
            "data": f"{describe_source(data_args)}; "
            + ", ".join(f"{len(dataset):,} {split} sentences" for split, dataset in processed.items())
            + f". Tags: {', '.join(tags.names)}. Scored with seqeval (entity-level, micro-averaged).",
            "intended_use": "Tagging the entity types above in text like its training data.",
            "limitations": "Sentence-level: it reads each sentence on its own. It knows only the entity types and "
            "the kind of text of its training data.",
        },
    )
    results = {"output_dir": training_args.output_dir, "labels": list(tags.names)}

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
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics

    # Prediction: metrics, and the predicted tag of every word in CoNLL layout
    if training_args.do_predict:
        logger.info("*** Predict ***")
        output = trainer.predict(predict_dataset, metric_key_prefix="test")
        metrics = output.metrics
        metrics["test_samples"] = len(predict_dataset)
        trainer.log_metrics("test", metrics)
        trainer.save_metrics("test", metrics)
        results["test"] = metrics
        if trainer.is_world_process_zero():
            predicted, _ = tag_sequences(output.predictions.argmax(-1), output.label_ids)
            path = Path(training_args.output_dir) / "predictions.txt"
            with path.open("w", encoding="utf-8") as writer:
                for words, sentence_tags in zip(raw_datasets["test"]["tokens"], predicted):
                    # Words cut off by --max_seq_length get no prediction: "O".
                    sentence_tags = sentence_tags + ["O"] * (len(words) - len(sentence_tags))
                    writer.writelines(f"{word} {tag}\n" for word, tag in zip(words, sentence_tags))
                    writer.write("\n")
            logger.info(f"Predictions written to {path}")

    card_kwargs = {"finetuned_from": model_args.model_name_or_path, "dataset": data_args.dataset_name}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card_kwargs)
    elif training_args.do_train:
        trainer.create_model_card(**card_kwargs)
    return results


if __name__ == "__main__":
    main()
