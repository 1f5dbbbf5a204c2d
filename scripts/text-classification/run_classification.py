#!/usr/bin/env python
"""Fine-tune and evaluate a RAN on document classification: single-label or multi-label, any number of classes, long
documents read whole (up to `--max_seq_length`, 4096 tokens by default, not 512).

    python scripts/text-classification/run_classification.py --model_name_or_path outputs/ran-mlm \\
        --train_file ../shared/data/hyperpartisan/train.jsonl \\
        --validation_file ../shared/data/hyperpartisan/dev.jsonl \\
        --test_file ../shared/data/hyperpartisan/test.jsonl \\
        --do_train --do_eval --do_predict --output_dir outputs/ran-hyperpartisan

Data: `--dataset_name` (Hub) or `--train_file` / `--validation_file` / `--test_file` in jsonl, jsonl.gz, csv or tsv,
with the text in `--text_column_name` and the label in `--label_column_name`. A label is a string, an int or a boolean
(single-label), or a list of them (multi-label: EURLEX-57K's EUROVOC ids); the task and the classes are read off the
whole splits (`--max_train_samples` keeps the first documents of a split, not fewer classes), and unknown, missing or
mixed labels stop the script before training. A test file without the label column is only predicted. Hub
`ClassLabel` features keep their names and order. Files are read through `datasets` into Arrow and cached
(`scripts/data_loading.py`).

Metrics (computed here with NumPy, since `evaluate.load("accuracy")` needs the Hub): single-label `accuracy` and
`macro_f1`; multi-label `micro_f1`, `macro_f1` and exact-match `accuracy`, a class counting as predicted when its
sigmoid is at least `--multi_label_threshold`. Predictions go to `predict_results.txt` (one line per test document).
"""

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import ClassLabel, List
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

from ran_hf.files.labels import ClassificationLabels, UnknownLabelsError


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: training_utils.py, shared by all examples

from checkpoints import prepare_output_dir  # noqa: E402
from data_loading import (  # noqa: E402
    check_data_limits,
    check_split_texts,
    cut_for_tokenizer,
    describe_source,
    first_examples,
    load_splits,
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
    trained_labels,
)

from ran_hf.files.folder_locks import releases_folder_locks  # noqa: E402


logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset (`datasets` name)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the Hub dataset."})
    train_file: str | None = field(default=None, metadata={"help": "Training documents: jsonl(.gz), csv or tsv."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation documents, same format."})
    test_file: str | None = field(
        default=None, metadata={"help": "Test documents, same format; scored when they carry labels."}
    )
    text_column_name: str = field(
        default="text", metadata={"help": "Column with the text; several separated by commas are joined by a space."}
    )
    label_column_name: str = field(default="label", metadata={"help": "Column with the label, or list of labels."})
    max_seq_length: int = field(
        default=4096,
        metadata={
            "at_least": 1,
            "help": "Documents are truncated to this many tokens. RAN's memory grows linearly with length.",
        },
    )
    multi_label_threshold: float = field(
        default=0.5,
        metadata={"above": 0, "below": 1, "help": "Multi-label: a class is predicted when its sigmoid reaches this."},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"at_least": 1, "help": "Processes for tokenization."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training documents."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation documents."}
    )
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep only the first N test documents."})

    def __post_init__(self):
        if self.dataset_name is None and not (self.train_file or self.validation_file or self.test_file):
            raise ValueError("Give --dataset_name or --train_file / --validation_file / --test_file.")
        check_data_limits(self)

    @property
    def text_columns(self) -> list[str]:
        return [column.strip() for column in self.text_column_name.split(",")]


def choose_labels(
    label_values: dict, column: str, class_names, model_args: ModelArguments, paths: dict | None = None
) -> ClassificationLabels:
    """The classes, in the order of the model's outputs.

    A trained classifier (`--model_name_or_path` with named classes in its `id2label`) keeps its own: the data's
    labels are mapped onto them, labels it lacks are an error, and a split may use only some of them. Otherwise, as
    with `--ignore_mismatched_sizes` and another number of classes (a new head), they are read off the data. `paths`
    (the split's files) let an error name the file and line of a bad label.
    """
    trained = trained_labels(model_args)
    if trained is None:
        return ClassificationLabels.from_splits(label_values, column, names=class_names, paths=paths)
    names, problem_type = trained
    model = model_args.config_name or model_args.model_name_or_path
    if model_args.ignore_mismatched_sizes and label_values:
        from_data = ClassificationLabels.from_splits(label_values, column, names=class_names, paths=paths)
        if len(from_data.names) != len(names):
            logger.warning(
                f"--ignore_mismatched_sizes: the head of {model} for its {len(names)} classes is replaced by a new "
                f"one for the data's {len(from_data.names)}."
            )
            return from_data
    multi_label = problem_type == "multi_label_classification"
    if not label_values:  # only predicting unlabelled documents
        return ClassificationLabels(names, multi_label)
    try:
        labels = ClassificationLabels.from_splits(
            label_values, column, names=names, names_from=f"the model {model}", paths=paths
        )
    except UnknownLabelsError as error:
        raise UnknownLabelsError(
            f"{error} Check --label_column_name; to train a new head for the data's classes, start from a model "
            "without one (run_mlm.py's, say), or pass --ignore_mismatched_sizes when their number differs."
        ) from None
    trained_kind_known = problem_type in ("single_label_classification", "multi_label_classification")
    if trained_kind_known and labels.multi_label != multi_label:
        kinds = {True: "multi-label (lists of labels)", False: "single-label"}
        raise ValueError(
            f"The model {model} is a {kinds[multi_label]} classifier but column {column!r} holds "
            f"{kinds[labels.multi_label]} data."
        )
    logger.info(
        f"Keeping the classes of {model} in their order: {list(names[:10])}{' ...' if len(names) > 10 else ''}"
    )
    return labels


def classification_metrics(logits: np.ndarray, labels: np.ndarray, multi_label: bool, threshold: float) -> dict:
    """Accuracy and macro-F1 (single-label); micro-F1, macro-F1 and exact-match accuracy (multi-label)."""
    num_classes = logits.shape[-1]
    if multi_label:
        predicted = 1.0 / (1.0 + np.exp(-logits)) >= threshold  # (B, C)
        actual = labels.astype(bool)
    else:
        predicted = np.eye(num_classes, dtype=bool)[logits.argmax(-1)]
        actual = np.eye(num_classes, dtype=bool)[labels]
    true_positives = (predicted & actual).sum(0)
    predicted_count, actual_count = predicted.sum(0), actual.sum(0)

    def f1(tp, predicted_total, actual_total):
        denominator = predicted_total + actual_total
        return np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)

    present = (actual_count + predicted_count) > 0  # macro-F1 over classes that occur or are predicted
    metrics = {
        "accuracy": float((predicted == actual).all(-1).mean()),
        "macro_f1": float(f1(true_positives, predicted_count, actual_count)[present].mean()) if present.any() else 0.0,
    }
    if multi_label:
        metrics["micro_f1"] = float(f1(true_positives.sum(), predicted_count.sum(), actual_count.sum()))
    return metrics


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

    # Data: every split read whole, its labels inferred and checked over the whole split (a run with
    # --max_*_samples has the classes of a full run), then the first --max_*_samples documents kept and their texts
    # checked (a null or blank text is an error, not the word "None")
    label_column = data_args.label_column_name
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    raw_datasets = load_splits(
        data_args.dataset_name,
        data_args.dataset_config_name,
        files,
        data_args.text_columns,
        optional_columns=(label_column,),  # a test split without labels is only predicted
        text_columns=tuple(data_args.text_columns),
        cache_dir=model_args.cache_dir,
        token=model_args.token,
        split_columns={
            "train": [label_column] if training_args.do_train else [],
            "validation": [label_column] if training_args.do_eval else [],
        },
        flags={
            **dict.fromkeys(data_args.text_columns, "--text_column_name"),
            label_column: "--label_column_name",
        },
    )
    for split, needed in (
        ("train", training_args.do_train),
        ("validation", training_args.do_eval),
        ("test", training_args.do_predict),
    ):
        if needed and split not in raw_datasets:
            raise ValueError(
                f"The {split} split is needed (--do_{'eval' if split == 'validation' else split}) but missing."
            )

    label_values, class_names = {}, None
    for split, dataset in raw_datasets.items():
        if label_column not in dataset.column_names:
            continue
        values = dataset[label_column][:]  # a list: iterating the column itself would read it row by row
        feature = dataset.features[label_column]
        feature = feature.feature if isinstance(feature, List) else feature
        if isinstance(feature, ClassLabel):  # Hub data: ids of named classes
            if all(value == -1 for value in values):  # a test split whose labels are hidden
                continue
            class_names = feature.names
            values = [feature.int2str(value) for value in values]
        label_values[split] = values
    if (training_args.do_train or training_args.do_eval) and not label_values:
        raise ValueError(f"No split has labels in column {label_column!r}.")
    paths = None if data_args.dataset_name else files  # a bad label is named by its file and line
    labels = choose_labels(label_values, label_column, class_names, model_args, paths)
    logger.info(
        f"{'Multi' if labels.multi_label else 'Single'}-label classification with {len(labels.names)} classes: "
        f"{list(labels.names[:10])}{' ...' if len(labels.names) > 10 else ''}"
    )
    limits = {
        "train": data_args.max_train_samples,
        "validation": data_args.max_eval_samples,
        "test": data_args.max_predict_samples,
    }
    raw_datasets = first_examples(raw_datasets, limits)
    check_split_texts(raw_datasets, data_args.text_columns, data_args)

    # Tokenizer, config and model
    tokenizer = load_tokenizer(model_args)
    config = load_config(
        model_args,
        tokenizer,
        num_labels=len(labels.names),
        id2label=dict(enumerate(labels.names)),
        label2id=labels.label2id,
        problem_type="multi_label_classification" if labels.multi_label else "single_label_classification",
        finetuning_task="text-classification",
    )
    model = load_model(AutoModelForSequenceClassification, model_args, config)

    # Preprocessing: token ids, and class ids (a list of them per document for multi-label) as "labels"
    def tokenize(examples):
        parts = zip(*(examples[column] for column in data_args.text_columns))
        texts = [" ".join(document) for document in parts]
        # Cut long documents first: tokenizing costs in proportion to --max_seq_length, not to the document.
        texts = cut_for_tokenizer(tokenizer, texts, data_args.max_seq_length)
        return tokenizer(texts, truncation=True, max_length=data_args.max_seq_length)

    processed = {}
    with training_args.main_process_first(desc="tokenization"):
        for split, dataset in raw_datasets.items():
            processed[split] = dataset.map(
                tokenize,
                batched=True,
                num_proc=data_args.preprocessing_num_workers,
                remove_columns=dataset.column_names,
                desc=f"Tokenizing {split}",
            )
            if split in label_values:  # the labels of the split's first documents, which it now holds
                kept = label_values[split][: len(dataset)]
                processed[split] = processed[split].add_column("labels", [labels.encode(v) for v in kept])
    for split, dataset in processed.items():
        lengths = [len(ids) for ids in dataset["input_ids"]]
        truncated = sum(length == data_args.max_seq_length for length in lengths)
        logger.info(
            f"{split}: {len(lengths):,} documents, {np.mean(lengths):.0f} tokens on average, longest "
            f"{max(lengths):,}; {truncated:,} truncated to {data_args.max_seq_length}"
        )
    train_dataset = processed.get("train") if training_args.do_train else None
    eval_dataset = processed.get("validation") if training_args.do_eval else None
    predict_dataset = processed.get("test") if training_args.do_predict else None

    def compute_metrics(eval_prediction):
        logits, gold = eval_prediction
        return classification_metrics(logits, gold, labels.multi_label, data_args.multi_label_threshold)

    padding_collator = DataCollatorWithPadding(tokenizer)

    def collate(features):
        """Pad the tokens; multi-label class ids become a multi-hot float matrix (B, num_labels)."""
        features = [dict(feature) for feature in features]
        label_ids = [feature.pop("labels") for feature in features] if "labels" in features[0] else None
        batch = padding_collator(features)
        if label_ids is not None and labels.multi_label:
            batch["labels"] = torch.zeros(len(label_ids), len(labels.names))
            for row, ids in enumerate(label_ids):
                batch["labels"][row, ids] = 1.0
        elif label_ids is not None:
            batch["labels"] = torch.tensor(label_ids)
        return batch

    trainer = RANTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collate,
        compute_metrics=compute_metrics,
        callbacks=[ParameterChecksumCallback(model_args.parameter_checksum_dir)]
        if model_args.parameter_checksum_dir
        else None,
        sentence_transformers_pooling=model_args.sentence_transformers_pooling,
        card={
            "task": f"{'multi' if labels.multi_label else 'single'}-label document classification "
            f"({len(labels.names)} classes)",
            "pipeline_tag": "text-classification",
            "auto_class": "AutoModelForSequenceClassification",
            "data": f"{describe_source(data_args)}; "
            + ", ".join(f"{len(dataset):,} {split} documents" for split, dataset in processed.items())
            + f"; text column `{data_args.text_column_name}`, label column `{label_column}`, documents truncated to "
            f"{data_args.max_seq_length} tokens. Classes: {', '.join(labels.names[:20])}"
            + (f" and {len(labels.names) - 20} more." if len(labels.names) > 20 else "."),
            "intended_use": "Classifying long documents of the kind it was trained on, into the classes above.",
            "limitations": "It knows only the classes and the kind of text of its training data; on other text its "
            "scores are not calibrated. Check it on your own validation data before relying on it.",
        },
    )
    results = {"output_dir": training_args.output_dir, "labels": list(labels.names)}

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

    # Prediction
    if training_args.do_predict:
        logger.info("*** Predict ***")
        has_labels = "labels" in predict_dataset.column_names
        output = trainer.predict(predict_dataset, metric_key_prefix="test")
        if has_labels:
            metrics = output.metrics
            metrics["test_samples"] = len(predict_dataset)
            trainer.log_metrics("test", metrics)
            trainer.save_metrics("test", metrics)
            results["test"] = metrics
        if trainer.is_world_process_zero():
            path = Path(training_args.output_dir) / "predict_results.txt"
            with path.open("w", encoding="utf-8") as writer:
                writer.write("index\tprediction\n")
                for index, row in enumerate(output.predictions):
                    if labels.multi_label:
                        chosen = np.flatnonzero(1.0 / (1.0 + np.exp(-row)) >= data_args.multi_label_threshold)
                        prediction = ",".join(labels.names[i] for i in chosen)
                    else:
                        prediction = labels.names[int(row.argmax())]
                    writer.write(f"{index}\t{prediction}\n")
            logger.info(f"Predictions written to {path}")

    card_kwargs = {"finetuned_from": model_args.model_name_or_path, "dataset": data_args.dataset_name}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card_kwargs)
    elif training_args.do_train:
        trainer.create_model_card(**card_kwargs)
    return results


if __name__ == "__main__":
    main()
