"""Bad data, script inputs and pipeline arguments refused with an error that names the input and the fix: duplicated
column names, multi-label data without a label, a label that is no class (NaN), a corpus too small to hold out a
validation split, a folder of an unknown model type, evaluation of the adaptive-softmax LM, and the extractive
question-answering pipeline's arguments and contexts.

Everything here builds its own small data and tokenizer (no ../shared/data); the scripts run in this process through
their `main(argv)` and stop before training, except the adaptive LM's run, which trains a step (slow).
"""

import json
import math
import time
from pathlib import Path

import evaluate_perplexity
import export_onnx
import pytest
import run_classification
import run_clm
import run_mlm
import torch
from train_tokenizer import TokenizerArguments, build_tokenizer
from transformers import pipeline

from ran_hf import RANConfig
from ran_hf.files.data import load_records, read_records
from ran_hf.files.labels import ClassificationLabels
from ran_hf.modeling_ran import RANForQuestionAnswering


WORDS = "the quick brown fox jumps over the lazy dog while a report on the planet was written by the old mayor"
TEXTS = [" ".join(WORDS.split()[i:] + WORDS.split()[:i]) for i in range(len(WORDS.split()))] * 3
TINY_OVERRIDES = (
    "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4,"
    "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
)
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning"]


@pytest.fixture(scope="module")
def tokenizer():
    arguments = TokenizerArguments(train_files=[], output_dir="unused", vocab_size=120, min_frequency=1)
    return build_tokenizer(arguments, TEXTS)


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---- data files -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,lines,column",
    [
        ("data.csv", ["text,label,label", "hello world,a,b", "bye now,b,a"], "label"),
        ("data.tsv", ["text\tlabel\tlabel", "hello world\ta\tb", "bye now\tb\ta"], "label"),
        ("data.csv", ["label,text,label", "a,hello world,b", "b,bye now,a"], "label"),
        ("data.jsonl", ['{"text": "hello world", "label": "a", "label": "b"}'], "label"),
        ("data.jsonl", ['{"text": "hello", "label": "a"}', '{"text": "x", "text": "y", "label": "b"}'], "text"),
    ],
)
def test_a_duplicated_column_name_is_refused_by_every_reader(tmp_path, name, lines, column):
    """The record-by-record reader kept the last of two `label` columns and the Arrow reader the first: both refuse."""
    path = write_lines(tmp_path / name, lines)
    pattern = rf"{path}.*line \d+.*{column!r}.*(twice|more than once)"
    with pytest.raises(ValueError, match=pattern):
        read_records(path)
    with pytest.raises(ValueError, match=pattern):
        load_records(path, ["text", "label"], cache_dir=str(tmp_path / "cache"))


def test_multi_label_data_without_any_label_is_refused(tmp_path):
    """Lists of labels that are all empty gave a classifier of zero classes."""
    path = write_lines(tmp_path / "train.jsonl", [json.dumps({"text": "a text", "label": []})] * 3)
    values = {"train": load_records(path, ["text", "label"], cache_dir=str(tmp_path / "cache"))["label"][:]}
    with pytest.raises(ValueError, match=rf"{path}.*'label'.*empty"):
        ClassificationLabels.from_splits(values, "label", paths={"train": path})
    with pytest.raises(ValueError, match="train split.*'label'.*empty"):
        ClassificationLabels.from_splits(values, "label")
    with pytest.raises(ValueError, match="empty"):  # a training split without any label, the others with some
        ClassificationLabels.from_splits({"train": [[], []], "validation": [["a"], []]}, "label")
    # some documents without a label are fine, and a trained model's classes may be scored on any of them
    assert ClassificationLabels.from_splits({"train": [["a"], [], ["b"]]}, "label").names == ("a", "b")
    assert ClassificationLabels.from_splits({"train": [[], []]}, "label", names=["a", "b"]).names == ("a", "b")


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "1.5", "2.0"])
def test_a_label_that_is_no_class_is_named_at_its_line(tmp_path, bad):
    """Arrow reads ints and one float as a column of floats: the error blamed record 1 (`float 1.0`), not line 4."""
    lines = [f'{{"text": "text {i}", "label": {label}}}' for i, label in enumerate([1, 0, 1, bad, 0])]
    path = write_lines(tmp_path / "train.jsonl", lines)
    values = {"train": load_records(path, ["text", "label"], cache_dir=str(tmp_path / "cache"))["label"][:]}
    expected = {"NaN": "nan", "Infinity": "inf", "1.5": "1.5", "2.0": "2.0"}[bad]
    with pytest.raises(ValueError, match=rf"{path}, line 4: column 'label' holds float {expected}"):
        ClassificationLabels.from_splits(values, "label", paths={"train": path})


def test_run_classification_names_the_bad_label_and_the_empty_label_lists(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(run_classification, "load_tokenizer", fail_if_called)  # refused before any model work
    lines = [json.dumps({"text": f"text {i}", "label": i % 2}) for i in range(6)]
    lines[4] = '{"text": "text 4", "label": NaN}'
    train = write_lines(tmp_path / "train.jsonl", lines)
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--do_train"] + QUIET
    with pytest.raises(ValueError, match=rf"{train}, line 5: column 'label' holds float nan"):
        run_classification.main(argv + ["--train_file", str(train), "--output_dir", str(tmp_path / "a")])
    empty = write_lines(tmp_path / "empty.jsonl", [json.dumps({"text": f"text {i}", "label": []}) for i in range(4)])
    with pytest.raises(ValueError, match=rf"{empty}.*'label'.*empty"):
        run_classification.main(argv + ["--train_file", str(empty), "--output_dir", str(tmp_path / "b")])


def fail_if_called(*args, **kwargs):
    raise AssertionError("the run went on to load the tokenizer and model")


# ---- language-modelling scripts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [run_mlm, run_clm])
def test_a_corpus_too_small_to_hold_out_a_validation_split_is_named(script, tokenizer_dir, tmp_path, monkeypatch):
    """One document, 5% held out: `datasets` said "the resulting train set will be empty", after nothing of the run."""
    monkeypatch.setattr(script, "load_tokenizer", fail_if_called)
    corpus = write_lines(tmp_path / "one.txt", ["a single line of text"])
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--train_file", str(corpus)]
    argv += ["--output_dir", str(tmp_path / "out"), "--do_train", "--do_eval"] + QUIET
    with pytest.raises(ValueError, match=rf"{corpus}.*1 document.*--validation_file.*--validation_split_percentage 0"):
        script.main(argv)


def write_unknown_model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "not-a-model", "hidden_size": 16}))
    return folder


@pytest.mark.parametrize("script", [run_mlm, run_clm, run_classification])
def test_a_folder_of_an_unknown_model_type_is_named(script, tokenizer_dir, tmp_path):
    folder = write_unknown_model(tmp_path / "model")
    records = [json.dumps({"text": text, "label": index % 2}) for index, text in enumerate(TEXTS)]
    train = write_lines(tmp_path / "train.jsonl", records)
    argv = ["--model_name_or_path", str(folder), "--tokenizer_name", str(tokenizer_dir), "--train_file", str(train)]
    argv += ["--output_dir", str(tmp_path / "out"), "--do_train", "--validation_split_percentage", "0"] + QUIET
    if script is run_classification:
        argv.remove("--validation_split_percentage")
        argv.remove("0")
    with pytest.raises(ValueError, match=rf"{folder}.*model_type 'not-a-model'.*import ran_hf.*--trust_remote_code"):
        script.main(argv)


def test_evaluate_perplexity_and_export_onnx_name_a_folder_of_an_unknown_model_type(tokenizer_dir, tmp_path):
    folder = write_unknown_model(tmp_path / "model")
    text = write_lines(tmp_path / "text.txt", TEXTS[:4])
    with pytest.raises(ValueError, match=rf"{folder}.*model_type 'not-a-model'.*--trust_remote_code"):
        evaluate_perplexity.main(
            ["--model_name_or_path", str(folder), "--tokenizer_name", str(tokenizer_dir), "--text_file", str(text)]
        )
    with pytest.raises(ValueError, match=rf"{folder}.*model_type 'not-a-model', not 'ran'"):
        export_onnx.load_model(str(folder))


@pytest.mark.slow
def test_run_clm_evaluates_the_adaptive_softmax_lm(tokenizer, tokenizer_dir, tmp_path):
    """Its output has no logits with labels: evaluation ended in `AttributeError: argmax` after training and saving."""
    config_dir = tmp_path / "config"
    RANConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        is_causal=True,
        cutoffs=[40, 80],
        div_val=2,
        hidden_size=16,
        num_attention_heads=2,
        head_dim=8,
        window_size=16,
        min_window_size=4,
    ).save_pretrained(config_dir)
    train = write_lines(tmp_path / "train.txt", TEXTS[:40])
    validation = write_lines(tmp_path / "validation.txt", TEXTS[40:])
    results = run_clm.main(
        ["--config_name", str(config_dir), "--tokenizer_name", str(tokenizer_dir), "--output_dir", str(tmp_path / "o")]
        + ["--train_file", str(train), "--validation_file", str(validation), "--block_size", "32"]
        + ["--do_train", "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "4"]
        + QUIET
    )
    assert math.isfinite(results["eval"]["eval_loss"]) and results["eval"]["perplexity"] > 1.0
    assert "eval_accuracy" not in results["eval"]
    assert json.loads((tmp_path / "o" / "eval_results.json").read_text())["perplexity"] > 1.0


# ---- the extractive question-answering pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def answer_finder(tokenizer):
    config = RANConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=16,
        num_attention_heads=2,
        head_dim=8,
        window_size=16,
        min_window_size=4,
    )
    torch.manual_seed(0)
    return pipeline("extractive-question-answering", model=RANForQuestionAnswering(config).eval(), tokenizer=tokenizer)


def test_a_huge_max_answer_len_costs_what_the_context_does(answer_finder, monkeypatch):
    """`max_answer_len=2e7` on a 5-token context built a (tokens x 2e7) score matrix: 3.5 GB and 17 s."""
    context = "the quick brown fox jumps"
    bounded = answer_finder(question="who wrote it", context=context, top_k=3, max_answer_len=5)
    largest = []
    pad = torch.nn.functional.pad

    def recording_pad(tensor, *args, **kwargs):
        padded = pad(tensor, *args, **kwargs)
        largest.append(padded.numel())
        return padded

    monkeypatch.setattr(torch.nn.functional, "pad", recording_pad)
    for huge in (20_000_000, 2e7, 10**18):
        start = time.perf_counter()
        answers = answer_finder(question="who wrote it", context=context, top_k=3, max_answer_len=huge)
        assert time.perf_counter() - start < 5
        assert answers == bounded
    assert max(largest, default=0) < 1000


@pytest.mark.parametrize(
    "arguments,message",
    [
        ({"top_k": 2.5}, r"`top_k` must be a positive integer, got 2\.5 \(float\)"),
        ({"top_k": "3"}, r"`top_k` must be a positive integer, got '3' \(str\)"),
        ({"top_k": True}, r"`top_k` must be a positive integer, got True \(bool\)"),
        ({"top_k": math.inf}, r"`top_k` must be a positive integer"),
        ({"top_k": 0}, r"`top_k` must be at least 1"),
        ({"max_answer_len": "30"}, r"`max_answer_len` must be a positive integer, got '30' \(str\)"),
        ({"max_answer_len": 1.5}, r"`max_answer_len` must be a positive integer, got 1\.5 \(float\)"),
        ({"max_answer_len": math.nan}, r"`max_answer_len` must be a positive integer"),
        ({"max_answer_len": 0}, r"`max_answer_len` must be at least 1"),
    ],
)
def test_pipeline_arguments_of_the_wrong_type_are_named(answer_finder, arguments, message):
    with pytest.raises(ValueError, match=message):
        answer_finder(question="who wrote it", context="the quick brown fox", **arguments)


def test_whole_numbers_are_taken_as_counts(answer_finder):
    answers = answer_finder(question="who wrote it", context="the quick brown fox", top_k=2.0, max_answer_len=3.0)
    assert len(answers) == 2


@pytest.mark.parametrize("field", ["context", "question"])
def test_a_text_that_gives_no_tokens_is_named(answer_finder, field):
    """Zero-width spaces are not whitespace to `str.strip`, and the tokenizer drops them: an IndexError followed."""
    texts = {"question": "who wrote it", "context": "the quick brown fox", field: "\u200b\u200b\u200b"}
    with pytest.raises(ValueError, match=rf"The {field} '\\u200b\\u200b\\u200b' gives no tokens"):
        answer_finder(**texts)


@pytest.mark.parametrize(
    "question,context",
    [(None, "the quick brown fox"), ("who wrote it", 5), (["who wrote it"], [b"the quick brown fox"])],
)
def test_a_question_or_context_that_is_not_text_is_named(answer_finder, question, context):
    with pytest.raises(ValueError, match=r"`(question|context)` must be a string or a list of strings"):
        answer_finder(question=question, context=context)
