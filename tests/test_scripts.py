"""The user-facing scripts: data readers, tokenizer training, pretraining, fine-tuning, evaluation, the pipeline, bad
input caught before training, and resuming after a run is killed.

Scripts run in this process through their `main(argv)` (a subprocess only where the test needs one: a run to kill,
a load where `ran_hf` is not importable), on tiny models and data generated here or read from ../shared/data.
"""

import csv
import errno
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import evaluate_perplexity
import pytest
import run_classification
import run_clm
import run_mlm
import run_ner
import run_pipeline
import torch
import train_tokenizer
import transformers
from checkpoints import missing_from_checkpoint, prepare_output_dir
from data_loading import cut_for_tokenizer
from huggingface_hub import ModelCard
from model_cards import design_words
from ran_trainer import parameter_checksum
from remote_code import run_without_ran_hf
from training_utils import RANTrainingArguments
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ran_hf import RANConfig, RANForSequenceClassification
from ran_hf.files.data import read_conll, read_records
from ran_hf.files.folder_locks import releases_folder_locks
from ran_hf.files.labels import ClassificationLabels, TagLabels


ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"  # conftest.py puts its folders on sys.path


# Windows of 16 tokens, so that every test document spans several; no dropout, so that runs are reproducible.
TINY_OVERRIDES = (
    "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4,"
    "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
)
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning"]


@pytest.fixture(scope="module")
def topic_files(tmp_path_factory):
    """Small synthetic long-document classification splits (see `run_pipeline.write_topic_documents`)."""
    folder = tmp_path_factory.mktemp("topics")
    return run_pipeline.write_topic_documents(folder, {"train": 24, "validation": 8, "test": 8}, seed=1)


@pytest.fixture(scope="module")
def tokenizer_dir(topic_files, tmp_path_factory):
    """A WordPiece tokenizer trained by `train_tokenizer.py` on the topic documents."""
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer.main(
        ["--train_files", str(topic_files["train"]), "--vocab_size", "300", "--output_dir", str(folder)]
    )
    return folder


def from_scratch(tokenizer_dir, output_dir) -> list[str]:
    """Arguments for a tiny from-scratch run writing to `output_dir`."""
    return [
        "--tokenizer_name",
        str(tokenizer_dir),
        "--config_overrides",
        TINY_OVERRIDES,
        "--output_dir",
        str(output_dir),
    ]


def write_jsonl(path: Path, records) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    return path


# ---- readers --------------------------------------------------------------------------------------------------------


def test_readers_accept_jsonl_gzip_csv_and_text(tmp_path):
    records = [{"text": "first document", "label": "a"}, {"text": "second, with a comma", "label": "b"}]
    write_jsonl(tmp_path / "data.jsonl", records)
    write_jsonl(tmp_path / "data.jsonl.gz", records)
    with open(tmp_path / "data.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(records)
    (tmp_path / "data.txt").write_text("first document\n\n   \nsecond, with a comma\n", encoding="utf-8")

    for name in ("data.jsonl", "data.jsonl.gz", "data.csv"):
        assert read_records(tmp_path / name) == records, name
    assert read_records(tmp_path / "data.txt") == [{"text": "first document"}, {"text": "second, with a comma"}]


def test_read_conll_skips_docstart_and_splits_sentences(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(
        "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n"
        "Peter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n"
    )
    assert read_conll(path) == [
        {"tokens": ["EU", "rejects"], "ner_tags": ["B-ORG", "O"]},
        {"tokens": ["Peter", "Blackburn"], "ner_tags": ["B-PER", "I-PER"]},
    ]


def test_labels_are_read_off_the_data():
    """Strings, booleans and ints are class names (numbers in numeric order); lists make the task multi-label."""
    labels = ClassificationLabels.from_splits({"train": ["true", "false", "true"], "validation": ["false"]}, "label")
    assert labels == ClassificationLabels(("false", "true"), multi_label=False)
    assert labels.encode("true") == 1
    assert ClassificationLabels.from_splits({"train": [True, False]}, "label").names == ("false", "true")
    assert ClassificationLabels.from_splits({"train": [10, 2, 1]}, "label").names == ("1", "2", "10")

    multi = ClassificationLabels.from_splits({"train": [["192", "20"], []], "validation": [["7"]]}, "label")
    assert multi == ClassificationLabels(
        ("7", "20", "192"), multi_label=True
    )  # the union: unseen ones count as misses
    assert multi.encode(["192", "7"]) == [0, 2]
    assert TagLabels.from_splits({"train": [["B-PER", "O", "I-PER"]]}).names == ("O", "B-PER", "I-PER")


@pytest.mark.parametrize(
    "splits, message",
    [
        pytest.param({"train": ["a", ["b"]]}, "mixes single labels .* and lists of labels", id="mixed-kinds"),
        pytest.param({"train": ["a", 0.5]}, "holds float 0.5", id="float"),
        pytest.param({"train": ["a", None]}, "is empty", id="null"),
        pytest.param({"train": ["a", ""]}, "holds an empty string", id="empty-string"),
        pytest.param({"train": [["a", ["b"]]]}, "nested list", id="nested-list"),
        pytest.param(
            {"train": ["a", "b"], "validation": ["c"]}, "labels the train split never uses: \\['c'\\]", id="unseen"
        ),
        pytest.param({"train": ["a", "a"]}, "a single class", id="one-class"),
    ],
)
def test_bad_labels_are_named(splits, message):
    with pytest.raises(ValueError, match=message):
        ClassificationLabels.from_splits(splits, "label")


@pytest.mark.parametrize(
    "name, content, message",
    [
        pytest.param("empty.jsonl", "", "holds no examples", id="empty-jsonl"),
        pytest.param("blank.txt", "\n  \n", "holds no examples", id="blank-text"),
        pytest.param("bad.jsonl", '{"text": "a"}\n{"text": \n', "line 2: not valid JSON", id="broken-json"),
        pytest.param("list.jsonl", "[1, 2]\n", "line 1: expected a JSON object", id="json-list"),
        pytest.param("ragged.csv", "text,label\na,b\nc,d,e\n", "line 3: 2 columns in the header", id="ragged-csv"),
    ],
)
def test_bad_files_are_named(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        read_records(tmp_path / name)


@pytest.mark.parametrize(
    "content, message",
    [
        pytest.param(
            "EU NNP B-NP B-ORG\nrejects VBZ O\n", "line 2: 3 columns, but the file started with 4", id="short"
        ),
        pytest.param("EU B-ORG\n\nPeter NNP B-PER\n", "line 3: 3 columns, but the file started with 2", id="long"),
        pytest.param("EU\n", "line 1: a CoNLL line needs a token and a tag", id="one-column"),
        pytest.param("-DOCSTART- -X- -X- O\n\n", "holds no sentences", id="only-docstart"),
    ],
)
def test_bad_conll_lines_are_named(tmp_path, content, message):
    (tmp_path / "train.txt").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_conll(tmp_path / "train.txt")


@pytest.mark.needs_data("conll2003", "hyperpartisan", "20newsgroups", "eurlex57k")
def test_readers_on_the_shared_benchmark_sets(data_dir):
    """The shared sets read with their published sizes and label formats."""
    conll = {split: read_conll(data_dir / "conll2003" / f"{split}.txt") for split in ("train", "valid", "test")}
    assert {split: len(sentences) for split, sentences in conll.items()} == {
        "train": 14041,
        "valid": 3250,
        "test": 3453,
    }
    assert sum(len(sentence["tokens"]) for sentence in conll["train"]) == 203621

    hyperpartisan = {
        split: read_records(data_dir / "hyperpartisan" / f"{split}.jsonl") for split in ("train", "dev", "test")
    }
    assert [len(records) for records in hyperpartisan.values()] == [516, 64, 65]
    labels = ClassificationLabels.from_splits(
        {s: [r["label"] for r in rs] for s, rs in hyperpartisan.items()}, "label"
    )
    assert labels == ClassificationLabels(("false", "true"), multi_label=False)

    newsgroups = read_records(data_dir / "20newsgroups" / "test.jsonl.gz")
    assert len(newsgroups) == 7532
    assert (
        len(ClassificationLabels.from_splits({"test": [r["label_name"] for r in newsgroups]}, "label_name").names)
        == 20
    )

    eurlex = read_records(data_dir / "eurlex57k" / "dev.jsonl.gz")
    assert len(eurlex) == 6000
    assert ClassificationLabels.from_splits({"dev": [r["label"] for r in eurlex]}, "label").multi_label


# ---- tokenizer -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["wordpiece", "bpe"])
def test_train_tokenizer_puts_pad_first(topic_files, tmp_path, model):
    train_tokenizer.main(
        [
            "--train_files",
            str(topic_files["train"]),
            "--model",
            model,
            "--vocab_size",
            "400",
            "--output_dir",
            str(tmp_path),
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tokenizer.pad_token_id == 0 and tokenizer.is_fast
    encoded = tokenizer("The rare planet orbits.")
    assert encoded.input_ids[0] == tokenizer.cls_token_id and encoded.input_ids[-1] == tokenizer.sep_token_id
    assert "token_type_ids" not in encoded  # RAN has no segment embedding


def test_train_tokenizer_reads_conll_words(tmp_path):
    conll = tmp_path / "train.txt"
    conll.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n")
    train_tokenizer.main(
        [
            "--train_files",
            str(conll),
            "--conll",
            "--vocab_size",
            "100",
            "--min_frequency",
            "1",
            "--output_dir",
            str(tmp_path / "tokenizer"),  # not tmp_path, which holds the training file
        ]
    )
    vocabulary = AutoTokenizer.from_pretrained(tmp_path / "tokenizer").get_vocab()
    assert {"eu", "rejects"} <= vocabulary.keys()
    assert "nnp" not in vocabulary and "b-org" not in vocabulary  # only the words, not the other columns


# ---- training scripts ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_mlm_from_scratch_then_continued(topic_files, tokenizer_dir, tmp_path, monkeypatch):
    """Pretraining writes a loadable model with its code, metrics as JSON and a filled model card; a second run
    continues from it with --model_name_or_path."""
    collated = []  # every batch the script's collator masked, to score the evaluation's again

    class RecordingCollator(run_mlm.DataCollatorForLanguageModeling):
        def __call__(self, *args, **kwargs):
            batch = super().__call__(*args, **kwargs)
            collated.append({key: value.clone() for key, value in batch.items()})
            return batch

    monkeypatch.setattr(run_mlm, "DataCollatorForLanguageModeling", RecordingCollator)
    first = tmp_path / "mlm"
    run_mlm.main(
        from_scratch(tokenizer_dir, first)
        + ["--train_file", str(topic_files["train"]), "--validation_file", str(topic_files["validation"])]
        + [
            "--max_seq_length",
            "64",
            "--do_train",
            "--do_eval",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
        ]
        + QUIET
    )
    assert {"model.safetensors", "modeling_ran.py", "configuration_ran.py", "tokenizer.json", "README.md"} <= {
        path.name for path in first.iterdir()
    }
    eval_results = json.loads((first / "eval_results.json").read_text())
    assert eval_results["perplexity"] == pytest.approx(torch.tensor(eval_results["eval_loss"]).exp().item(), rel=1e-5)
    # The accuracy is the saved (final) model's on the masked tokens of the evaluation's batches, the last ones
    # masked (eight rows each by default), and on no other token.
    eval_batches = -(-eval_results["eval_samples"] // 8)  # rounded up
    evaluated = collated[-eval_batches:]
    assert sum(len(batch["input_ids"]) for batch in evaluated) == eval_results["eval_samples"]
    model = transformers.AutoModelForMaskedLM.from_pretrained(first).eval()
    right = scored = 0
    with torch.no_grad():
        for batch in evaluated:
            masked = batch["labels"] != -100
            predictions = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.argmax(-1)
            right += int((predictions[masked] == batch["labels"][masked]).sum())
            scored += int(masked.sum())
    assert eval_results["eval_accuracy"] == pytest.approx(right / scored)
    config = json.loads((first / "config.json").read_text())
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(tokenizer_dir)) and config["pad_token_id"] == 0
    assert config["architectures"] == ["RANForMaskedLM"] and config["window_size"] == 16
    card = (first / "README.md").read_text()
    assert "masked language modelling, trained from scratch" in card
    assert f"| eval_loss | {eval_results['eval_loss']:.4g} |" in card
    assert "trust_remote_code=True" in card and "2306.06843" in card
    assert "$" not in card  # every placeholder filled
    metadata = ModelCard.load(first / "README.md").data  # what the Hub reads: metrics as a model-index
    scored = {entry.metric_type: entry.metric_value for entry in metadata.eval_results}
    assert scored["loss"] == pytest.approx(eval_results["eval_loss"]) and "runtime" not in scored
    assert metadata.pipeline_tag == "fill-mask" and metadata.base_model is None

    continued = run_mlm.main(
        ["--model_name_or_path", str(first), "--output_dir", str(tmp_path / "continued")]
        + ["--train_file", str(topic_files["train"]), "--line_by_line", "--max_seq_length", "64"]
        + ["--do_train", "--max_steps", "1", "--validation_split_percentage", "0"]
        + QUIET
    )
    assert continued["train"]["train_samples"] == 24  # one example per document
    continued_card = (tmp_path / "continued" / "README.md").read_text()
    assert "fine-tuned from a model trained locally (`mlm`)" in continued_card and str(tmp_path) not in continued_card


@pytest.mark.parametrize("script", [run_clm, run_mlm])
def test_packing_trains_on_documents_packed_in_one_row(script, topic_files, tokenizer_dir, tmp_path, monkeypatch):
    """`--packing`: every batch is one row of whole documents without padding, their boundaries marked by restarting
    `position_ids`; the masked LM's masks never fall on special tokens and keep every document's labels."""
    batches = []
    collator_class = run_clm.DataCollatorWithFlattening if script is run_clm else run_mlm.PackedMaskedLMCollator

    class Recording(collator_class):
        def __call__(self, features, *args, **kwargs):
            batch = super().__call__(features, *args, **kwargs)
            batches.append(([list(feature["input_ids"]) for feature in features], batch))
            return batch

    monkeypatch.setattr(script, collator_class.__name__, Recording)
    length = ["--block_size" if script is run_clm else "--max_seq_length", "48"]
    results = script.main(
        from_scratch(tokenizer_dir, tmp_path / "packed")
        + ["--train_file", str(topic_files["train"]), "--validation_file", str(topic_files["validation"])]
        + length
        + ["--packing", "--do_train", "--do_eval", "--max_steps", "3", "--per_device_train_batch_size", "4"]
        + QUIET
    )
    assert math.isfinite(results["train"]["train_loss"]) and math.isfinite(results["eval"]["eval_loss"])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for documents, batch in batches:
        assert batch["input_ids"].shape == (1, sum(map(len, documents)))  # one row, no padding
        expected = torch.cat([torch.arange(len(document)) for document in documents])
        assert torch.equal(batch["position_ids"][0], expected)
        labels = batch["labels"][0]
        if script is run_clm:  # the inputs, with no document predicted from the one before
            starts = expected == 0
            assert (labels[starts] == -100).all() and torch.equal(labels[~starts], batch["input_ids"][0][~starts])
        else:  # masks on the documents' own tokens only; a masked token's label is what it was
            flat = torch.tensor([token for document in documents for token in document])
            masked = labels != -100
            assert torch.equal(labels[masked], flat[masked])
            special = torch.tensor(tokenizer.get_special_tokens_mask(flat.tolist(), already_has_special_tokens=True))
            assert not (masked & special.bool()).any()
    assert any(len(documents) > 1 for documents, _ in batches)


@pytest.mark.parametrize(
    "script, extra, message",
    [
        (run_clm, ["--stream_training"], "Give one of them"),
        (run_mlm, ["--pad_to_multiple_of", "8"], "Give one of them"),
    ],
)
def test_packing_with_an_option_it_contradicts_is_refused(script, extra, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        script.main(
            [
                "--tokenizer_name",
                "t",
                "--output_dir",
                str(tmp_path / "o"),
                "--train_file",
                "x.txt",
                "--packing",
                *extra,
            ]
        )


def test_a_card_describes_the_layer_its_model_was_built_with():
    """A causal model's card describes its associative memory with the design's state-tracking table (the figure
    markers left out); the official layer's card (the encoder's default) names its origin."""
    causal = design_words(RANConfig(is_causal=True))
    assert "associative memory" in causal and "| causal RAN of this design" in causal and "32K |" in causal
    assert "<!--" not in causal and "$" not in causal
    assert design_words(RANConfig(is_causal=True, associative_memory=False)) == ""
    assert "`rannet`" in design_words(RANConfig()) and "`rannet`" in design_words(
        RANConfig(is_causal=True, layer_design="official")
    )


@pytest.mark.slow
def test_run_clm_then_perplexity_over_a_stream(topic_files, tokenizer_dir, tmp_path):
    """A causal model trains on blocks, and the streamed perplexity equals the one of a single forward pass."""
    output_dir = tmp_path / "clm"
    results = run_clm.main(
        from_scratch(tokenizer_dir, output_dir)
        + ["--train_file", str(topic_files["train"]), "--validation_file", str(topic_files["validation"])]
        + ["--block_size", "64", "--do_train", "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "4"]
        + QUIET
    )
    assert results["eval"]["perplexity"] > 1.0
    assert json.loads((output_dir / "config.json").read_text())["is_causal"] is True
    card = (output_dir / "README.md").read_text()
    assert "| associative memory (key convolution, decay) | True (4, False) |" in card and "<!--" not in card

    text_file = tmp_path / "text.txt"
    text_file.write_text("\n".join(json.loads(line)["text"][:300] for line in topic_files["test"].open()) + "\n")
    stream = evaluate_perplexity.main(
        ["--model_name_or_path", str(output_dir), "--text_file", str(text_file), "--chunk_length", "37"]
        + ["--output_file", str(tmp_path / "perplexity.json")]
    )
    chunks = evaluate_perplexity.main(
        [
            "--model_name_or_path",
            str(output_dir),
            "--text_file",
            str(text_file),
            "--chunk_length",
            "37",
            "--mode",
            "chunks",
        ]
    )
    assert json.loads((tmp_path / "perplexity.json").read_text())["token_perplexity"] == stream["token_perplexity"]
    assert stream["scored_tokens"] == stream["tokens"] - 1
    assert chunks["scored_tokens"] == stream["tokens"] - -(
        -stream["tokens"] // 37
    )  # every chunk's first token unscored
    assert stream["words"] == sum(len(line.split()) + 1 for line in text_file.read_text().splitlines())

    model = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    input_ids, _ = evaluate_perplexity.read_stream(str(text_file), AutoTokenizer.from_pretrained(output_dir))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[0, :-1]
    one_pass = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:], reduction="sum").item()
    assert stream["nll_nats"] == pytest.approx(one_pass, rel=1e-4)


def test_run_classification_multi_label_from_gzipped_jsonl(tokenizer_dir, tmp_path, topic_files):
    """EURLEX-style lists of label ids: multi-label, with micro-F1, and predictions written as label lists."""
    documents = [json.loads(line) for line in topic_files["train"].open()]
    records = [
        {"body": d["text"], "tags": [d["label"], "long"] if i % 2 else [d["label"]]} for i, d in enumerate(documents)
    ]
    train = write_jsonl(tmp_path / "train.jsonl.gz", records[:16])
    validation = write_jsonl(tmp_path / "validation.jsonl.gz", records[16:])
    test = write_jsonl(
        tmp_path / "test.jsonl", [{"body": r["body"]} for r in records[16:20]]
    )  # no labels: predict only
    output_dir = tmp_path / "classifier"
    results = run_classification.main(
        from_scratch(tokenizer_dir, output_dir)
        + ["--train_file", str(train), "--validation_file", str(validation), "--test_file", str(test)]
        + ["--text_column_name", "body", "--label_column_name", "tags", "--max_seq_length", "96"]
        + ["--do_train", "--do_eval", "--do_predict", "--max_steps", "2", "--per_device_train_batch_size", "4"]
        + QUIET
    )
    config = json.loads((output_dir / "config.json").read_text())
    assert config["problem_type"] == "multi_label_classification"
    assert "long" in config["label2id"] and len(config["id2label"]) == len(results["labels"])
    assert {"eval_micro_f1", "eval_macro_f1", "eval_accuracy"} <= results["eval"].keys()
    assert "test" not in results  # the test file has no labels
    lines = (output_dir / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 5
    assert all(set(line.split("\t")[1].split(",")) <= set(results["labels"]) | {""} for line in lines[1:])


def test_run_classification_reads_a_dataset_by_name(tokenizer_dir, tmp_path, topic_files):
    """--dataset_name goes through `datasets.load_dataset`; a local folder of split files exercises that path
    offline."""
    dataset_dir = tmp_path / "dataset"
    dataset_dir.mkdir()
    shutil.copy(topic_files["train"], dataset_dir / "train.jsonl")
    shutil.copy(topic_files["validation"], dataset_dir / "validation.jsonl")
    results = run_classification.main(
        from_scratch(tokenizer_dir, tmp_path / "classifier")
        + ["--dataset_name", str(dataset_dir), "--max_seq_length", "96", "--do_train", "--do_eval", "--max_steps", "1"]
        + QUIET
    )
    assert results["labels"] == sorted({json.loads(line)["label"] for line in topic_files["train"].open()})
    assert "eval_accuracy" in results["eval"]


@pytest.mark.slow
def test_run_ner_on_conll_files(tmp_path):
    """CoNLL in, seqeval entity scores out, with a prediction for every word of the test file."""
    sentences = [
        ("EU rejects German call to boycott British lamb .", "B-ORG O B-MISC O O O B-MISC O O"),
        ("Peter Blackburn", "B-PER I-PER"),
        ("BRUSSELS 1996-08-22", "B-LOC O"),
        ("The European Commission said on Thursday", "O B-ORG I-ORG O O O"),
    ]
    lines = ["-DOCSTART- -X- -X- O", ""]
    for words, tags in sentences * 4:
        lines += [f"{word} NN B-NP {tag}" for word, tag in zip(words.split(), tags.split())] + [""]
    conll = tmp_path / "train.txt"
    conll.write_text("\n".join(lines) + "\n")
    tokenizer_dir = tmp_path / "tokenizer"
    train_tokenizer.main(
        ["--train_files", str(conll), "--conll", "--vocab_size", "120", "--output_dir", str(tokenizer_dir)]
    )

    output_dir = tmp_path / "ner"
    results = run_ner.main(
        from_scratch(tokenizer_dir, output_dir)
        + ["--train_file", str(conll), "--validation_file", str(conll), "--test_file", str(conll)]
        + ["--do_train", "--do_eval", "--do_predict", "--max_steps", "2", "--return_entity_level_metrics"]
        + QUIET
    )
    assert results["labels"] == ["O", "B-LOC", "B-MISC", "B-ORG", "B-PER", "I-ORG", "I-PER"]
    assert {"eval_f1", "eval_precision", "eval_recall", "eval_accuracy", "eval_PER_f1"} <= results["eval"].keys()
    assert "test_f1" in results["test"]
    predicted = [line.split() for line in (output_dir / "predictions.txt").read_text().splitlines() if line]
    gold = list(read_conll(conll))
    assert [word for word, _ in predicted] == [word for sentence in gold for word in sentence["tokens"]]
    assert json.loads((output_dir / "config.json").read_text())["id2label"]["4"] == "B-PER"


def test_subword_tags_go_to_the_first_piece(tokenizer_dir):
    """A word split into pieces carries its tag on the first piece only (on every piece with --label_all_tokens,
    B- turned into I-); special tokens are ignored."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = ["supernovaobservatory", "the"]  # the first is not in the vocabulary: several pieces
    pieces = len(tokenizer.tokenize(words[0]))
    assert pieces > 1
    word_ids = tokenizer(words, is_split_into_words=True).word_ids()
    tag_ids, inside_of = [1, 0], {1: 2}  # B-X = 1, I-X = 2, O = 0
    assert run_ner.align_tags(word_ids, tag_ids, inside_of, False) == [-100, 1] + [-100] * (pieces - 1) + [0, -100]
    assert run_ner.align_tags(word_ids, tag_ids, inside_of, True) == [-100, 1] + [2] * (pieces - 1) + [0, -100]


@pytest.mark.slow
def test_pipeline_trains_saves_and_reloads_without_ran_hf(tmp_path):
    """The main job end to end on generated data; the classifier loads where `ran_hf` cannot be imported."""
    output_dir = tmp_path / "pipeline"
    summary = run_pipeline.main(
        ["--output_dir", str(output_dir), "--synthetic_documents", "16,8,8", "--vocab_size", "300"]
        + ["--hidden_size", "16", "--num_attention_heads", "2", "--window_size", "16", "--max_seq_length", "128"]
        + ["--mlm_epochs", "1", "--epochs", "1", "--torch_threads", "0"]
    )
    classifier = Path(summary["output_dir"])
    assert {"model.safetensors", "modeling_ran.py", "README.md", "all_results.json", "predict_results.txt"} <= {
        path.name for path in classifier.iterdir()
    }
    assert set(summary["test"]) >= {"test_accuracy", "test_macro_f1"}
    assert json.loads((output_dir / "pipeline_results.json").read_text()) == summary
    assert "single-label document classification (6 classes)" in (classifier / "README.md").read_text()

    tokenizer = AutoTokenizer.from_pretrained(classifier)
    texts = [json.loads(line)["text"] for line in (output_dir / "data" / "test.jsonl").open()][:3]
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = AutoModelForSequenceClassification.from_pretrained(classifier).eval()(**inputs).logits
    torch.save({"inputs": dict(inputs), "logits": expected}, tmp_path / "expected.pt")
    report = run_without_ran_hf(LOAD_CLASSIFIER, [classifier, tmp_path / "expected.pt"], tmp_path)
    assert report["class"].startswith("transformers_modules.") and report["class"].endswith(
        "RANForSequenceClassification"
    )
    assert report["max_difference"] <= 1e-5


LOAD_CLASSIFIER = r"""
import torch
from transformers import AutoModelForSequenceClassification

folder, expected_file = sys.argv[1], sys.argv[2]
expected = torch.load(expected_file)
model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(**expected["inputs"]).logits
report["class"] = type(model).__module__ + "." + type(model).__name__
report["max_difference"] = (logits - expected["logits"]).abs().max().item()
"""


# ---- bad input stops a script before training -----------------------------------------------------------------------


@pytest.fixture
def saved_classifier_with(tokenizer_dir, tmp_path):
    """Factory: a tiny RAN classifier saved with the test tokenizer and the given config fields."""

    def save(**fields):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = RANConfig(
            **{"vocab_size": len(tokenizer), "hidden_size": 16, "num_attention_heads": 2, "head_dim": 8, **fields}
        )
        folder = tmp_path / "saved"
        RANForSequenceClassification(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return save


def classification_argv(tokenizer_dir, tmp_path, train, validation=None, *extra):
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + [
        "--train_file",
        str(train),
        "--do_train",
        "--max_steps",
        "1",
    ]
    if validation is not None:
        argv += ["--validation_file", str(validation), "--do_eval"]
    return argv + list(extra) + QUIET


def test_missing_text_column(tokenizer_dir, tmp_path, topic_files):
    argv = classification_argv(tokenizer_dir, tmp_path, topic_files["train"], None, "--text_column_name", "body")
    with pytest.raises(ValueError, match=r"has no column 'body'; its columns are \['label', 'text'\]"):
        run_classification.main(argv)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_missing_label_column(tokenizer_dir, tmp_path, topic_files):
    argv = classification_argv(tokenizer_dir, tmp_path, topic_files["train"], None, "--label_column_name", "topic")
    with pytest.raises(ValueError, match="has no column 'topic'; its columns are .* --label_column_name"):
        run_classification.main(argv)


@pytest.mark.parametrize(
    "train_labels, validation_labels, message",
    [
        pytest.param(["a", "b"], [["a"]], "mixes single labels", id="list-in-validation"),
        pytest.param(["a", "b"], ["c"], "labels the train split never uses", id="unseen-class"),
        pytest.param([0.5, 1.5], [0.5], "holds float 0.5", id="float-labels"),
        pytest.param([{"name": "a"}, {"name": "b"}], [{"name": "a"}], "holds dict", id="dict-labels"),
        pytest.param(
            ["a", ["b"]],
            ["a"],
            r"column 'label' mixes a string \(record 1\) and a list \(record 2\)",
            id="mixed-in-file",
        ),
    ],
)
def test_labels_that_do_not_fit_the_task(tokenizer_dir, tmp_path, train_labels, validation_labels, message):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "some words", "label": label} for label in train_labels])
    validation = write_jsonl(
        tmp_path / "dev.jsonl", [{"text": "more words", "label": label} for label in validation_labels]
    )
    with pytest.raises(ValueError, match=message):
        run_classification.main(classification_argv(tokenizer_dir, tmp_path, train, validation))


def test_empty_training_file(tokenizer_dir, tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ValueError, match="train.jsonl holds no examples"):
        run_classification.main(classification_argv(tokenizer_dir, tmp_path, tmp_path / "train.jsonl"))


def test_conll_line_with_the_wrong_number_of_columns(tokenizer_dir, tmp_path):
    (tmp_path / "train.txt").write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP O\ncall NN\n")
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--train_file", str(tmp_path / "train.txt"), "--do_train"]
    with pytest.raises(ValueError, match="train.txt, line 3: 2 columns, but the file started with 4"):
        run_ner.main(argv + QUIET)


@pytest.mark.parametrize(
    "fields, message",
    [
        pytest.param(
            {"vocab_size": 50}, r"The tokenizer has \d+ tokens but the model's vocabulary has 50", id="vocab"
        ),
        pytest.param({"pad_token_id": 1}, "pads with id 0 .* but the model config has pad_token_id=1", id="pad-id"),
    ],
)
def test_tokenizer_that_disagrees_with_the_model(
    saved_classifier_with, tokenizer_dir, tmp_path, topic_files, fields, message
):
    folder = saved_classifier_with(**fields)
    argv = [
        "--model_name_or_path",
        str(folder),
        "--tokenizer_name",
        str(tokenizer_dir),
        "--output_dir",
        str(tmp_path / "o"),
    ]
    argv += ["--train_file", str(topic_files["train"]), "--do_train", "--max_steps", "1"] + QUIET
    with pytest.raises(ValueError, match=message):
        run_classification.main(argv)
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_config_overrides_that_break_the_config(tokenizer_dir, tmp_path, topic_files):
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", "window_size=8,min_window_size=8"]
    argv += ["--output_dir", str(tmp_path), "--train_file", str(topic_files["train"]), "--do_train"] + QUIET
    with pytest.raises(ValueError, match=r"`min_window_size` \(8\) must be smaller than `window_size` \(8\)"):
        run_mlm.main(argv)


# ---- faults: a killed run resumes where its last complete checkpoint left it ----------------------------------------


def classification_run(tokenizer_dir, topic_files, output_dir, max_steps: int) -> list[str]:
    """A tiny classifier run that saves a checkpoint every 2 steps; dropout on, so that RNG states matter."""
    overrides = TINY_OVERRIDES.replace("dropout_prob=0.0", "dropout_prob=0.1")
    return (
        ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", overrides, "--output_dir", str(output_dir)]
        + ["--train_file", str(topic_files["train"]), "--max_seq_length", "64", "--do_train"]
        + ["--max_steps", str(max_steps), "--save_steps", "2", "--per_device_train_batch_size", "2"]
        + ["--learning_rate", "1e-3", "--parameter_checksum_dir", str(output_dir / "checksums")]
        + QUIET
    )


def complete_checkpoints(output_dir: Path) -> list[Path]:
    found = [path for path in output_dir.glob("checkpoint-*") if not missing_from_checkpoint(path)]
    return sorted(found, key=lambda path: int(path.name.split("-")[1]))


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_state(tokenizer_dir, topic_files, tmp_path, caplog):
    """SIGKILL after the first checkpoint, then --resume_from_checkpoint latest: training continues from the newest
    complete checkpoint (a half-written one after it is skipped) and ends with the weights of an uninterrupted run."""
    max_steps = 60
    reference_dir = tmp_path / "reference"
    run_classification.main(classification_run(tokenizer_dir, topic_files, reference_dir, max_steps))
    reference = json.loads((reference_dir / "checksums" / "rank-0.json").read_text())

    killed_dir = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    process = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPTS / "text-classification" / "run_classification.py"),
            *classification_run(tokenizer_dir, topic_files, killed_dir, max_steps),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not complete_checkpoints(killed_dir) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate()
    assert process.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {stderr.decode()[-2000:]}"
    assert not (killed_dir / "model.safetensors").exists()
    survivors = complete_checkpoints(killed_dir)
    assert survivors, "no complete checkpoint was written before the kill"
    last = survivors[-1]
    step = int(last.name.split("-")[1])
    assert step < max_steps

    # Every complete checkpoint holds the whole training state, identical to the reference run's at that step.
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert (last / name).is_file(), name
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == step
    for name in ("optimizer.pt", "scheduler.pt"):
        saved, expected = torch.load(last / name), torch.load(reference_dir / last.name / name)
        assert_same_state(saved, expected, name)

    # What a kill while saving leaves: a newer folder whose trainer_state.json (written last) is missing or cut.
    for broken_step, damage in ((step + 2, "missing"), (step + 4, "truncated")):
        broken = killed_dir / f"checkpoint-{broken_step}"
        if broken.exists():
            shutil.rmtree(broken)
        shutil.copytree(last, broken)
        if damage == "missing":
            (broken / "trainer_state.json").unlink()
        else:
            (broken / "trainer_state.json").write_text((last / "trainer_state.json").read_text()[:40])

    with pytest.raises(
        ValueError, match=f"Cannot resume from .*checkpoint-{step + 2}: it lacks a readable trainer_state"
    ):
        run_classification.main(
            classification_run(tokenizer_dir, topic_files, killed_dir, max_steps)
            + ["--resume_from_checkpoint", str(killed_dir / f"checkpoint-{step + 2}")]
        )
    with caplog.at_level("INFO"):
        results = run_classification.main(
            classification_run(tokenizer_dir, topic_files, killed_dir, max_steps)
            + ["--resume_from_checkpoint", "latest"]
        )
    assert f"Skipping {killed_dir / f'checkpoint-{step + 4}'}" in caplog.text
    assert f"Resuming from {last}" in caplog.text
    resumed = json.loads((killed_dir / "checksums" / "rank-0.json").read_text())
    assert resumed == reference
    assert results["train"]["train_samples"] > 0
    state = json.loads((killed_dir / "trainer_state.json").read_text())
    assert state["global_step"] == max_steps


def assert_same_state(actual, expected, name):
    """Nested optimizer / scheduler states are equal, tensors exactly."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), name
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), name
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{name}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), name
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same_state(a, e, f"{name}[{index}]")
    else:
        assert actual == expected, name


def test_resume_latest_without_checkpoints_starts_fresh(tokenizer_dir, topic_files, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        run_classification.main(
            classification_run(tokenizer_dir, topic_files, tmp_path, 2) + ["--resume_from_checkpoint", "latest"]
        )
    assert "No complete checkpoint" in caplog.text
    assert json.loads((tmp_path / "trainer_state.json").read_text())["global_step"] == 2


def test_parameter_checksum_matches_the_saved_model(tokenizer_dir, topic_files, tmp_path):
    run_classification.main(classification_run(tokenizer_dir, topic_files, tmp_path, 2))
    record = json.loads((tmp_path / "checksums" / "rank-0.json").read_text())
    assert record["global_step"] == 2
    assert record["sha256"] == parameter_checksum(AutoModelForSequenceClassification.from_pretrained(tmp_path))


# ---- a previous run is never lost, nor mixed with a new one -------------------------------------------------------


def files_of(folder: Path) -> dict[str, bytes]:
    """{relative path: content} of every file under `folder`."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def tiny_run(tokenizer_dir, topic_files, output_dir, *extra) -> list[str]:
    return (
        from_scratch(tokenizer_dir, output_dir)
        + ["--train_file", str(topic_files["train"]), "--max_seq_length", "64", "--do_train"]
        + ["--per_device_train_batch_size", "4", "--max_steps", "2", *extra]
        + QUIET
    )


@pytest.mark.slow
def test_a_finished_run_is_replaced_only_when_asked(tokenizer_dir, topic_files, tmp_path):
    """Re-running into a finished run's folder silently replaced its model and merged its eval metrics into the new
    all_results.json and model card. Now it is refused, naming the folder, and left as it was; with
    --overwrite_output_dir the new run replaces it and nothing of the old run's metrics remains."""
    output_dir = tmp_path / "run"
    evaluate = ["--validation_file", str(topic_files["validation"]), "--do_eval", "--save_steps", "1"]
    run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, *evaluate))
    before = files_of(output_dir)
    assert "eval_results.json" in before and "checkpoint-1/optimizer.pt" in before

    second_run = tiny_run(tokenizer_dir, topic_files, output_dir, "--max_steps", "3", "--seed", "7")
    with pytest.raises(ValueError, match=rf"--output_dir {output_dir} already holds a previous run .*--overwrite"):
        run_classification.main(second_run)
    assert files_of(output_dir) == before

    run_classification.main(second_run + ["--overwrite_output_dir"])
    after = files_of(output_dir)
    assert after["model.safetensors"] != before["model.safetensors"]
    assert not any(name.startswith("eval_") for name in json.loads(after["all_results.json"]))
    assert "eval_results.json" not in after and "eval_loss" not in after["README.md"].decode()
    assert {name.split("/")[0] for name in after if name.startswith("checkpoint-")} == {"checkpoint-3"}
    assert json.loads(after["trainer_state.json"])["global_step"] == 3


@pytest.mark.slow
def test_a_folder_with_checkpoints_needs_resume_or_overwrite(tokenizer_dir, topic_files, tmp_path):
    """A run into a folder holding another run's checkpoints warned and started over, mixing its checkpoints with the
    old ones (where `latest` would later pick an old one). Now it is refused, pointing to both ways on; resuming in
    the run's own folder needs no flag."""
    output_dir = tmp_path / "run"
    run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, "--save_steps", "2"))
    (output_dir / "model.safetensors").unlink()  # as if killed before its final save
    with pytest.raises(ValueError, match="Pass --resume_from_checkpoint latest to continue it, --overwrite_output"):
        run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir))
    results = run_classification.main(
        tiny_run(tokenizer_dir, topic_files, output_dir, "--max_steps", "4", "--resume_from_checkpoint", "latest")
    )
    assert results["train"]["epoch"] > 0 and (output_dir / "model.safetensors").is_file()
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == 4


def test_latest_without_a_checkpoint_does_not_replace_a_finished_run(tokenizer_dir, topic_files, tmp_path):
    """`latest` in a finished folder without checkpoints would start from scratch over it: refused unasked."""
    output_dir = tmp_path / "run"
    run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, "--save_strategy", "no"))
    resume = ["--save_strategy", "no", "--resume_from_checkpoint", "latest"]
    with pytest.raises(ValueError, match="already holds a previous run"):
        run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, *resume))


def test_the_pipeline_refuses_before_retraining_its_tokenizer(tmp_path):
    (tmp_path / "mlm").mkdir()
    (tmp_path / "mlm" / "model.safetensors").write_bytes(b"an earlier model")
    with pytest.raises(ValueError, match="holds an earlier pipeline's models .* --overwrite_output_dir"):
        run_pipeline.main(["--output_dir", str(tmp_path), "--synthetic_documents", "4,2,2"])
    assert not (tmp_path / "tokenizer").exists()


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it, so only `finally` blocks run."""


@pytest.mark.slow
def test_the_final_save_is_all_or_nothing(tokenizer_dir, topic_files, tmp_path, monkeypatch):
    """A full disk while saving over a model left the new config.json beside the old, cut weights. Now the folder
    keeps the old model, whole, and nothing is left beside it."""
    output_dir = tmp_path / "run"
    run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, "--save_steps", "1"))
    before = files_of(output_dir)
    write = transformers.modeling_utils.safe_save_file

    def disk_full(tensors, filename, *args, **kwargs):
        if "checkpoint-" in str(filename):
            return write(tensors, filename, *args, **kwargs)
        Path(filename).write_bytes(b"\0" * 100)  # what fits before the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    wider = TINY_OVERRIDES.replace("window_size=16", "window_size=32")
    argv = tiny_run(tokenizer_dir, topic_files, output_dir, "--overwrite_output_dir", "--config_overrides", wider)
    with pytest.raises(OSError, match="No space left"):
        run_classification.main(argv + ["--save_strategy", "no"])
    after = files_of(output_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "all_results.json", "README.md"):
        assert after[name] == before[name], name
    assert AutoModelForSequenceClassification.from_pretrained(output_dir).config.window_size == 16
    assert [path.name for path in tmp_path.iterdir()] == ["run"]


def test_the_final_save_into_the_working_directory(tokenizer_dir, topic_files, tmp_path, monkeypatch):
    """`--output_dir .`: the folder replaced is the working directory, which then moves to the new one; the saved
    folder has the umask's permissions, not those of a temporary folder (0700)."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    monkeypatch.chdir(output_dir)
    umask = os.umask(0o022)
    try:
        run_classification.main(tiny_run(tokenizer_dir, topic_files, "."))
    finally:
        os.umask(umask)
    assert Path.cwd() == output_dir and (Path.cwd() / "model.safetensors").is_file()
    assert [path.name for path in tmp_path.iterdir()] == ["run"]
    assert output_dir.stat().st_mode & 0o777 == 0o755
    assert (output_dir / "model.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_a_kill_between_the_two_renames_is_undone_by_the_next_run(tokenizer_dir, topic_files, tmp_path, monkeypatch):
    """Killed after the old folder was set aside and before the new one took its place: the next run puts the old
    folder back, whole, and resumes from its checkpoint."""
    output_dir = tmp_path / "run"
    run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, "--save_steps", "2"))
    before = files_of(output_dir)
    replace = os.replace

    def killed_before_the_new_folder_moves_in(source, destination):
        if Path(source).name.startswith(".run.saving-"):
            raise Killed
        replace(source, destination)

    monkeypatch.setattr(os, "replace", killed_before_the_new_folder_moves_in)
    with pytest.raises(Killed):
        run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, "--resume_from_checkpoint", "latest"))
    monkeypatch.setattr(os, "replace", replace)
    assert not output_dir.exists()
    (set_aside,) = [path for path in tmp_path.iterdir() if path.name.startswith(".run.previous-")]
    set_aside = set_aside.rename(tmp_path / f".run.previous-{finished_process_id()}-x")  # its process is gone
    set_aside_files = files_of(set_aside / "run")
    assert all(set_aside_files[name] == content for name, content in before.items())  # the old run, whole

    results = run_classification.main(
        tiny_run(tokenizer_dir, topic_files, output_dir, "--max_steps", "4", "--resume_from_checkpoint", "latest")
    )
    assert results["train"]["train_samples"] > 0 and [path.name for path in tmp_path.iterdir()] == ["run"]
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == 4


def test_a_kill_after_the_new_folder_moved_in_is_finished_by_the_next_run(tmp_path):
    """Killed after the new folder took its place and before the old one was emptied: the next run moves the old
    folder's checkpoints and other entries over, and deletes its model, metrics and card."""
    output_dir = tmp_path / "run"
    (output_dir / "checkpoint-4").mkdir(parents=True)
    (output_dir / "config.json").write_text("new")
    old = tmp_path / f".run.previous-{finished_process_id()}-y" / "run"
    for name in ("checkpoint-2", "runs"):
        (old / name).mkdir(parents=True)
        (old / name / "file").write_text(name)
    for name in ("config.json", "model.safetensors", "all_results.json", "eval_results.json", "README.md"):
        (old / name).write_text("old")
    releases_folder_locks(prepare_output_dir)(RANTrainingArguments(output_dir=str(output_dir), do_train=False))
    assert files_of(output_dir) == {
        "config.json": b"new",
        "checkpoint-2/file": b"checkpoint-2",
        "runs/file": b"runs",
    }
    assert [path.name for path in tmp_path.iterdir()] == ["run"]


def finished_process_id() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# ---- damaged checkpoints ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_with_checkpoints(tokenizer_dir, topic_files, tmp_path_factory):
    """A finished tiny run with checkpoint-2 and checkpoint-4."""
    output_dir = tmp_path_factory.mktemp("checkpoints") / "run"
    run_classification.main(tiny_run(tokenizer_dir, topic_files, output_dir, "--max_steps", "4", "--save_steps", "2"))
    return output_dir


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_middle_byte(path: Path) -> None:
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x01
    path.write_bytes(bytes(content))


@pytest.mark.parametrize(
    "name, damage, problem",
    [
        pytest.param("model.safetensors", cut_in_half, "incomplete metadata", id="weights-cut"),
        pytest.param("optimizer.pt", cut_in_half, "not a complete torch.save archive", id="optimizer-cut"),
        pytest.param("optimizer.pt", flip_middle_byte, "fails its CRC-32 check", id="optimizer-flipped-byte"),
        pytest.param("scheduler.pt", cut_in_half, "not a complete torch.save archive", id="scheduler-cut"),
        pytest.param("rng_state.pth", lambda path: path.write_bytes(b""), "not a complete", id="rng-empty"),
    ],
)
def test_latest_skips_a_checkpoint_whose_files_do_not_load(
    run_with_checkpoints, tmp_path, caplog, name, damage, problem
):
    """`latest` took the newest checkpoint even with a cut or damaged file and crashed in Trainer with a bare
    SafetensorError / RuntimeError / OSError. Now such a checkpoint is skipped, naming the file, for the newest one
    that loads; named explicitly, it is an error before any training."""
    output_dir = tmp_path / "run"
    shutil.copytree(run_with_checkpoints, output_dir)
    damage(output_dir / "checkpoint-4" / name)
    args = RANTrainingArguments(output_dir=str(output_dir), do_train=True, resume_from_checkpoint="latest")
    with caplog.at_level("WARNING"):
        assert prepare_output_dir(args) == str(output_dir / "checkpoint-2")
    assert re.search(rf"Skipping .*checkpoint-4: it lacks an intact {re.escape(name)} \(.*{problem}", caplog.text)
    args.resume_from_checkpoint = str(output_dir / "checkpoint-4")
    with pytest.raises(ValueError, match=rf"Cannot resume from .*checkpoint-4: it lacks an intact {re.escape(name)}"):
        prepare_output_dir(args)


def test_resuming_past_a_damaged_checkpoint(run_with_checkpoints, tokenizer_dir, topic_files, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(run_with_checkpoints, output_dir)
    cut_in_half(output_dir / "checkpoint-4" / "optimizer.pt")
    run_classification.main(
        tiny_run(tokenizer_dir, topic_files, output_dir, "--max_steps", "4", "--resume_from_checkpoint", "latest")
    )
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and missing_from_checkpoint(output_dir / "checkpoint-4") == []


# ---- training length and data -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        pytest.param(["--num_train_epochs", "0"], "--num_train_epochs must be positive, got 0.0", id="zero-epochs"),
        pytest.param(["--num_train_epochs", "-1"], "--num_train_epochs must be positive", id="negative-epochs"),
        pytest.param(["--num_train_epochs", "nan"], "--num_train_epochs must be positive, got nan", id="nan-epochs"),
        pytest.param(["--max_steps", "0"], r"--max_steps must be positive \(or -1", id="zero-steps"),
        pytest.param(["--max_steps", "-5"], r"--max_steps must be positive \(or -1.*got -5", id="negative-steps"),
    ],
)
def test_a_training_length_that_trains_nothing(tokenizer_dir, topic_files, tmp_path, flags, message):
    """These exited 0 with an untrained model and a model card; now they stop before anything is read or written."""
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--train_file", str(topic_files["train"]), "--do_train"]
    with pytest.raises(ValueError, match=message):
        run_classification.main(argv + flags + QUIET)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name, content, message",
    [
        pytest.param("null.jsonl", '{"text": "a"}\n\n{"text": null}\n', "line 3: column 'text' holds null", id="null"),
        pytest.param("empty.jsonl", '{"text": "a"}\n{"text": ""}\n', "line 2: .* holds an empty string", id="empty"),
        pytest.param("blank.jsonl", '{"text": " \\t\\n "}\n', "line 1: .* holds only whitespace", id="blank"),
        pytest.param("number.jsonl", '{"text": 12}\n', "line 1: column 'text' holds int 12, not text", id="number"),
        pytest.param("blank.csv", "text,label\na,b\n   ,c\n", "line 3: .* holds only whitespace", id="csv-blank"),
    ],
)
def test_texts_that_are_null_empty_or_blank(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=f"{name}, {message}"):
        read_records(tmp_path / name, text_columns=["text"])


def test_a_null_text_is_not_trained_as_the_word_none(tokenizer_dir, tmp_path, topic_files):
    records = [json.loads(line) for line in topic_files["train"].open()]
    records[5]["text"] = None
    train = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(ValueError, match=r"train.jsonl, line 6: column 'text' holds null"):
        run_classification.main(classification_argv(tokenizer_dir, tmp_path, train))


def test_max_samples_keep_the_first_documents_and_the_classes_of_the_whole_split(tokenizer_dir, tmp_path):
    """The classes come from whole splits: with --max_train_samples 4 the first four documents hold two of the three
    classes, and a validation document of the third is still scored, not refused. Only the kept texts are read and
    checked: a null text after them does not stop the run."""
    records = [{"text": f"words of document {i}", "label": "ab"[i % 2]} for i in range(4)]
    records += [{"text": "a third kind", "label": "c"}, {"text": None, "label": "a"}]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    validation = write_jsonl(tmp_path / "dev.jsonl", [{"text": "more words", "label": label} for label in "abc"])
    argv = classification_argv(tokenizer_dir, tmp_path, train, validation, "--max_train_samples", "4")
    results = run_classification.main(argv)
    assert results["labels"] == ["a", "b", "c"]
    assert results["train"]["train_samples"] == 4 and results["eval"]["eval_samples"] == 3
    with pytest.raises(ValueError, match=r"train.jsonl, line 6: column 'text' holds null"):
        run_classification.main(classification_argv(tokenizer_dir, tmp_path / "all", train, validation))


@pytest.mark.slow
def test_max_samples_keep_the_tags_of_the_whole_split(tokenizer_dir, tmp_path):
    sentences = [{"tokens": ["Peter", "spoke"], "ner_tags": ["B-PER", "O"]}]
    sentences += [{"tokens": ["Paris", "and", "Rome"], "ner_tags": ["B-LOC", "O", "B-LOC"]}]
    train = write_jsonl(tmp_path / "train.jsonl", sentences)
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--train_file", str(train), "--do_train", "--do_eval"]
    argv += ["--validation_file", str(train), "--max_steps", "1", "--max_train_samples", "1"]
    results = run_ner.main(argv + QUIET)
    assert results["labels"] == ["O", "B-LOC", "B-PER"]
    assert results["train"]["train_samples"] == 1


def test_a_null_text_in_a_hub_dataset(tokenizer_dir, tmp_path, topic_files):
    """Through `--dataset_name` the error names the split and the example."""
    dataset_dir = tmp_path / "dataset"
    dataset_dir.mkdir()
    records = [json.loads(line) for line in topic_files["train"].open()]
    records[4]["text"] = None
    write_jsonl(dataset_dir / "train.jsonl", records)
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--dataset_name", str(dataset_dir), "--do_train"]
    with pytest.raises(ValueError, match=r"dataset \(train\), example 5: column 'text' holds null"):
        run_classification.main(argv + QUIET)


def test_an_all_blank_file_does_not_train(tokenizer_dir, tmp_path):
    """All-whitespace texts trained and evaluated with exit 0 (classification) or failed deep in Trainer (run_mlm)."""
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": "   ", "label": "ab"[i % 2]} for i in range(8)])
    message = "blank.jsonl, line 1: column 'text' holds only whitespace"
    with pytest.raises(ValueError, match=message):
        run_classification.main(classification_argv(tokenizer_dir, tmp_path, blank, blank))
    argv = from_scratch(tokenizer_dir, tmp_path / "mlm") + ["--train_file", str(blank), "--do_train"]
    with pytest.raises(ValueError, match=message):
        run_mlm.main(argv + QUIET)


def test_blank_documents_of_a_hub_corpus_are_dropped_and_an_empty_split_is_an_error(tokenizer_dir, tmp_path):
    """Hub corpora such as WikiText hold empty rows by design: dropped; a split with nothing else is an error."""
    dataset_dir = tmp_path / "dataset"
    dataset_dir.mkdir()
    write_jsonl(dataset_dir / "train.jsonl", [{"text": "the planet orbits"}, {"text": ""}, {"text": "a star"}])
    write_jsonl(dataset_dir / "validation.jsonl", [{"text": ""}, {"text": "  "}])
    argv = from_scratch(tokenizer_dir, tmp_path / "mlm") + ["--dataset_name", str(dataset_dir), "--do_train"]
    with pytest.raises(ValueError, match="The validation split holds no text: its 2 documents are all blank"):
        run_mlm.main(argv + ["--max_steps", "1"] + QUIET)


@pytest.mark.parametrize(
    "name, line",
    [("data.jsonl", 2), ("data.jsonl.gz", 2), ("data.csv", 3), ("data.txt", 2), ("conll.txt", 2)],
)
def test_bytes_that_are_not_utf8_are_named_with_file_and_line(tmp_path, name, line):
    """A bare UnicodeDecodeError (no file, no line) before; now the file, the line and the byte."""
    rows = {
        "data.jsonl": ['{"text": "fine"}', '{"text": "caf\xe9"}'],
        "data.jsonl.gz": ['{"text": "fine"}', '{"text": "caf\xe9"}'],
        "data.csv": ["text,label", "fine,a", "caf\xe9,b"],
        "data.txt": ["fine", "caf\xe9"],
        "conll.txt": ["EU B-ORG", "caf\xe9 O"],
    }[name]
    content = ("\n".join(rows) + "\n").encode("latin-1")
    (tmp_path / name).write_bytes(gzip.compress(content) if name.endswith(".gz") else content)
    reader = read_conll if name == "conll.txt" else read_records
    with pytest.raises(ValueError, match=rf"{re.escape(name)}, line {line}: not valid UTF-8 \(byte 0xe9 at column"):
        reader(tmp_path / name)


@pytest.mark.parametrize(
    "content, message",
    [
        pytest.param(
            'text,label\na,x\n"b is never closed,y\nc,x\nd,y\n', r"line 3: not valid CSV \(unexpected", id="open-quote"
        ),
        pytest.param('text,label\na,x\n"b" c,y\n', r"line 3: not valid CSV \(',' expected after", id="after-quote"),
        pytest.param('text,label\n"a\nspans lines",x\nb,y,z\n', r"line 4: 2 columns in the header", id="ragged"),
    ],
)
def test_csv_errors_are_reported_where_the_record_starts(tmp_path, content, message):
    """An unclosed quote swallowed the rest of the file and was reported at its last line (or, if the columns still
    matched, trained on the merged text); text after a closing quote was read silently."""
    (tmp_path / "data.csv").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_records(tmp_path / "data.csv")


def test_csv_fields_may_be_as_long_as_a_document(tmp_path):
    """The csv module's default field limit (128 KB) is below a long document's length."""
    text = "word " * 60_000
    (tmp_path / "long.csv").write_text(f'text,label\n"{text}",a\n')
    assert read_records(tmp_path / "long.csv") == [{"text": text, "label": "a"}]
    assert csv.field_size_limit() == 131072  # restored


def test_a_null_ner_sentence(tmp_path, tokenizer_dir):
    sentences = [{"tokens": ["EU"], "ner_tags": ["B-ORG"]}, {"tokens": None, "ner_tags": []}]
    train = write_jsonl(tmp_path / "train.jsonl", sentences)
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--train_file", str(train), "--do_train"]
    named = r"train.jsonl:2 \(train sentence 2\): column 'tokens' must be a non-empty list, got None"
    with pytest.raises(ValueError, match=named):
        run_ner.main(argv + QUIET)


# ---- long documents: tokenizing costs in proportion to the limit --------------------------------------------------


@pytest.mark.needs_data("hyperpartisan", "wikitext-2", "conll2003")
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("max_length", [8, 64, 512])
def test_cutting_long_documents_keeps_the_truncated_ids(wordpiece_tokenizer, data_dir, side, max_length):
    """The ids of a cut document, truncated, are those of the whole document, truncated, on the longest documents
    of Hyperpartisan and 20 Newsgroups, and on text without any whitespace."""
    tokenizer = wordpiece_tokenizer
    tokenizer.truncation_side = side
    documents = [record["text"] for record in read_records(data_dir / "hyperpartisan" / "dev.jsonl")]
    documents = sorted(documents, key=len)[-8:] + ["x" * 50_000, "ab,cd;" * 20_000]
    cut = cut_for_tokenizer(tokenizer, documents, max_length)
    assert len(cut[-1]) < len(documents[-1]) / 4  # punctuation without spaces: cut where a character limit falls
    whole = tokenizer(documents, truncation=True, max_length=max_length)["input_ids"]
    assert tokenizer(cut, truncation=True, max_length=max_length)["input_ids"] == whole


def test_a_huge_single_line_document_is_tokenized_within_the_limit(tokenizer_dir, tmp_path, monkeypatch):
    """A 50 MB single-line document with --max_seq_length 256 took 8.2 GB and 100 s, all of it tokenized to keep
    256 tokens. Now the tokenizer never sees more than a few thousand characters of it (20 MB here, to stay fast)."""
    words = "the planet orbits a distant star while the recipe simmers slowly".split()
    huge = " ".join(words[i % len(words)] for i in range(3_400_000))
    records = [{"text": huge, "label": "a"}] + [{"text": f"short text {i}", "label": "ab"[i % 2]} for i in range(7)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    longest = []
    call = transformers.PreTrainedTokenizerBase.__call__

    def measured(self, text=None, *args, **kwargs):
        texts = [text] if isinstance(text, str) else list(text or [])
        longest.append(max((len(item) for item in texts if isinstance(item, str)), default=0))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", measured)
    run_classification.main(classification_argv(tokenizer_dir, tmp_path, train, None, "--max_seq_length", "256"))
    assert len(huge) > 20_000_000 and max(longest) < 20_000


# ---- a missing column, a file that is not UTF-8: the error names the file, what it holds and the fix ----------------


MISSING_COLUMNS = [
    ("train", "--label_column_name", "topic"),
    ("validation", "--label_column_name", "topic"),
    ("train", "--text_column_name", "body"),
    ("validation", "--text_column_name", "body"),
]


def missing_column_message(source: str, column: str, flag: str) -> str:
    return rf"^{re.escape(source)} has no column '{column}'; its columns are \['label', 'text'\]\. .*{flag}\.$"


@pytest.mark.parametrize("split, flag, column", MISSING_COLUMNS)
def test_a_missing_column_names_the_file_its_columns_and_the_flag(tokenizer_dir, tmp_path, split, flag, column):
    """The label column's error said only "The train split has no label column": it names what the text column's
    does, by one check (the file, the columns it has, the flag to set), before any model is built."""
    good = {"text": "a", column: "x"} if flag == "--label_column_name" else {column: "a", "label": "x"}
    bad = {"text": "a", "label": "x"}
    files = {
        name: write_jsonl(tmp_path / f"{name}.jsonl", [bad if name == split else good] * 4)
        for name in ("train", "validation")
    }
    argv = classification_argv(tokenizer_dir, tmp_path, files["train"], files["validation"], flag, column)
    with pytest.raises(ValueError, match=missing_column_message(str(files[split]), column, flag)):
        run_classification.main(argv)
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("flag, column", [("--label_column_name", "topic"), ("--text_column_name", "body")])
def test_a_missing_column_of_a_dataset_by_name_names_its_split_and_the_flag(tokenizer_dir, tmp_path, flag, column):
    """The same check for --dataset_name (a local folder of split files stands in for the Hub)."""
    dataset_dir = tmp_path / "dataset"
    dataset_dir.mkdir()
    for name in ("train", "validation"):
        write_jsonl(dataset_dir / f"{name}.jsonl", [{"text": "a", "label": "x"}] * 4)
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--dataset_name", str(dataset_dir), "--do_train"]
    argv += ["--do_eval", "--max_steps", "1", flag, column] + QUIET
    with pytest.raises(ValueError, match=missing_column_message(f"{dataset_dir} (train)", column, flag)):
        run_classification.main(argv)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_test_file_without_labels_is_still_only_predicted(tokenizer_dir, tmp_path, topic_files):
    """The label column is required where a run trains or scores, not in a test file, which is only predicted."""
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "the planet orbits"}, {"text": "the recipe simmers"}])
    argv = classification_argv(tokenizer_dir, tmp_path, topic_files["train"], None, "--test_file", str(test))
    run_classification.main(argv + ["--do_predict", "--max_seq_length", "32"])
    assert len((tmp_path / "out" / "predict_results.txt").read_text().splitlines()) == 1 + 2  # a header, then each


@pytest.mark.parametrize("flag", ["--tokens_column_name", "--tags_column_name"])
def test_run_ner_names_its_own_flag_for_a_missing_column(tokenizer_dir, tmp_path, flag):
    """A jsonl file without the tokens or tags column is named with run_ner's flag for it (the error suggested
    run_classification's --text_column_name / --label_column_name)."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"tokens": ["EU", "rejects"], "ner_tags": ["B-ORG", "O"]}] * 4)
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--train_file", str(train), "--do_train", flag, "words"]
    with pytest.raises(ValueError, match=rf"train.jsonl has no column 'words'; .* Name the column with {flag}\.$"):
        run_ner.main(argv + QUIET)


def test_run_clm_names_its_flag_for_a_missing_text_column(tokenizer_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "the planet orbits the sun"}] * 4)
    argv = from_scratch(tokenizer_dir, tmp_path / "out") + ["--train_file", str(train), "--do_train"]
    with pytest.raises(
        ValueError, match=r"train.jsonl has no column 'body'; .* Name the column with --text_column_name"
    ):
        run_clm.main(argv + ["--text_column_name", "body"] + QUIET)
