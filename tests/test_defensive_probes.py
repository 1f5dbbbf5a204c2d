"""Issue 46's own probes, after its cases were fixed: the same surfaces (question answering, the prefix LM's features,
the data readers, the output folders) tried with new inputs. Each test here failed before its fix: a raw library
error, a silent wrong result, a user's file replaced, or work unbounded by what is kept."""

import copy
import gzip
import os
import re

import pytest
import torch
from argument_checks import apply_config_overrides
from ran_testing import CONFIG_ERROR
from test_nothing_lost import RANNET_FIXTURE, files_of
from transformers import BertTokenizerFast, pipeline

from ran_hf import (
    RANConfig,
    RANForCausalLM,
    RANForPrefixLM,
    RANForQuestionAnswering,
    convert_rannet_checkpoint,
    export_onnx,
    prefix_lm_features,
)
from ran_hf.files.data import load_records, read_records
from ran_hf.files.folders import write_folder
from ran_hf.files.labels import ClassificationLabels
from ran_hf.integrations.seq2seq_features import truncated_ids


TINY = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 8,
    "window_size": 4,
}


@pytest.fixture(scope="module")
def wordpiece():
    """A WordPiece tokenizer of 16 ids: [PAD] = 0, the letters a to k."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijk"]
    return BertTokenizerFast(vocab={word: index for index, word in enumerate(words)})


@pytest.fixture(scope="module")
def answer_finder(wordpiece):
    torch.manual_seed(0)
    model = RANForQuestionAnswering(RANConfig(**TINY, min_window_size=2)).eval()
    return pipeline("extractive-question-answering", model=model, tokenizer=wordpiece)


# ---- question answering: the pipeline ------------------------------------------------------------------------------


def test_the_pipeline_answers_empty_lists_with_an_empty_list(answer_finder):
    """Empty lists of questions and contexts ended in Transformers' IndexError."""
    assert answer_finder(question=[], context=[]) == []


def test_the_pipeline_names_a_batch_size_it_cannot_use(answer_finder, wordpiece):
    """`batch_size=2` ended in a TypeError printing the whole model ("argument after ** must be a mapping")."""
    with pytest.raises(ValueError, match=r"`batch_size=2`: this pipeline reads each \(question, context\) pair whole"):
        answer_finder(question=["a", "b"], context=["c d", "e f g"], batch_size=2)
    batched = pipeline("extractive-question-answering", model=answer_finder.model, tokenizer=wordpiece, batch_size=4)
    with pytest.raises(ValueError, match=r"`batch_size=4`"):
        batched(question=["a", "b"], context=["c d", "e f g"])
    assert len(answer_finder(question=["a", "b"], context=["c d", "e f g"], batch_size=1)) == 2


def test_the_pipeline_names_logits_that_are_not_finite(answer_finder, wordpiece):
    """A model whose logits are NaN (diverged weights, float16 overflow) ended in an IndexError: no span scored."""
    model = RANForQuestionAnswering(RANConfig(**TINY, min_window_size=2)).eval()
    with torch.no_grad():
        model.qa_outputs.weight.fill_(float("nan"))
    broken = pipeline("extractive-question-answering", model=model, tokenizer=wordpiece)
    with pytest.raises(ValueError, match=r"`start_logits` over the context hold NaN or infinite values"):
        broken(question="a", context="b c d")


@pytest.mark.parametrize("top_k", [1, 3])
def test_a_confident_model_still_answers(answer_finder, top_k):
    """Large finite logits, the likeliest start after the likeliest end: every span's product of probabilities
    underflowed to 0, so `top_k=1` raised an IndexError and `top_k=3` answered []. Spans are scored in log space."""
    inputs = answer_finder.preprocess({"question": "a", "context": "b c d e"})
    context = inputs["in_context"].nonzero().flatten()
    start, end = torch.zeros(len(inputs["in_context"])), torch.zeros(len(inputs["in_context"]))
    start[context[-1]], end[context[0]] = 200.0, 200.0
    answers = answer_finder.postprocess({"start_logits": start, "end_logits": end, **inputs}, top_k=top_k)
    answers = [answers] if top_k == 1 else answers
    assert len(answers) == top_k
    assert all(answer["start"] < answer["end"] and answer["answer"] for answer in answers)


def test_scores_are_still_the_products_of_probabilities(answer_finder):
    inputs = answer_finder.preprocess({"question": "a", "context": "b c d e"})
    start, end = torch.randn(len(inputs["in_context"])), torch.randn(len(inputs["in_context"]))
    answers = answer_finder.postprocess({"start_logits": start, "end_logits": end, **inputs}, top_k=100)
    in_context = inputs["in_context"]
    start_probs = start.masked_fill(~in_context, -torch.inf).softmax(-1)
    end_probs = end.masked_fill(~in_context, -torch.inf).softmax(-1)
    expected = sorted(
        (start_probs[s] * end_probs[e]).item()
        for s in range(len(start))
        for e in range(s, len(end))
        if in_context[s] and in_context[e]
    )[::-1]
    assert [answer["score"] for answer in answers] == pytest.approx(expected, rel=1e-5)


# ---- the prefix LM's features --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_source_length", [1, 2])
def test_a_source_length_with_no_room_for_the_source_is_refused(wordpiece, max_source_length):
    """`max_source_length=1` kept the whole source (the tokenizer cannot cut into [CLS] ... [SEP], and only warns);
    2 kept none of it."""
    with pytest.raises(ValueError, match=rf"`max_source_length={max_source_length}` leaves no room.*at least 3"):
        prefix_lm_features(wordpiece, "a b c", "d", max_source_length=max_source_length)
    assert prefix_lm_features(wordpiece, "a b c", "d", max_source_length=3)["input_ids"][:3] == [2, 5, 3]


@pytest.mark.parametrize("source, target", [(["a b", "c"], "d"), ("a b", ["c", "d"]), (b"a b", "c"), ("a", 5)])
def test_a_source_or_target_that_is_not_one_string_is_refused(wordpiece, source, target):
    """A list of sources was encoded into nested lists inside `input_ids`, with no error."""
    with pytest.raises(ValueError, match=r"The (source|target) must be one string"):
        prefix_lm_features(wordpiece, source, target)


@pytest.mark.parametrize(
    "source, target, which", [("a", "", "target"), ("a", "\u200b\u200b", "target"), ("", "a", "source")]
)
def test_a_source_or_target_without_tokens_is_refused(wordpiece, source, target, which):
    """A target of zero-width spaces gave a target of only [SEP]: a pair that teaches the model to stop at once."""
    with pytest.raises(ValueError, match=rf"The {which} .* gives no tokens"):
        prefix_lm_features(wordpiece, source, target)


class CountingTokenizer:
    """Passes calls to a tokenizer and keeps the length of the longest text it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_long_source_is_tokenized_only_as_far_as_it_is_kept(wordpiece):
    """A 4 MB source cut to 16 tokens took 8 s and 1.2 GB: it was tokenized whole, then truncated."""
    counting = CountingTokenizer(wordpiece)
    features = prefix_lm_features(counting, "a " * 2_000_000, "b", max_source_length=16)
    assert features["input_ids"][:16] == [2] + [5] * 14 + [3]
    assert counting.longest < 10_000


@pytest.mark.parametrize("max_length", [3, 4, 7, 20, 200])
def test_truncated_ids_equal_the_whole_texts(wordpiece, max_length):
    generator = torch.Generator().manual_seed(max_length)
    letters = "abcdefghijk"
    words = [
        "".join(letters[i] for i in torch.randint(0, 11, (int(n),), generator=generator))
        for n in torch.randint(1, 300, (400,), generator=generator)
    ]  # words of up to 300 letters (a WordPiece word over 100 characters is one [UNK])
    for separator in (" ", "\n", "  \t"):
        text = separator.join(words)
        expected = wordpiece(text, truncation=True, max_length=max_length)["input_ids"]
        assert truncated_ids(wordpiece, text, max_length) == expected
    one_word = "abc" * 5000  # no whitespace to cut at: read whole
    assert truncated_ids(wordpiece, one_word, 5) == wordpiece(one_word, truncation=True, max_length=5)["input_ids"]


# ---- data readers --------------------------------------------------------------------------------------------------


def cut_gzip(path, lines: int) -> None:
    data = gzip.compress(b"".join(b'{"text": "line %d", "label": "x"}\n' % i for i in range(lines)))
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("reader", [read_records, lambda path: load_records(path, ["text", "label"])])
def test_a_cut_gzip_file_is_named(tmp_path, reader):
    """A half-written `.jsonl.gz` ended in EOFError ("Compressed file ended before the end-of-stream marker was
    reached"), naming no file."""
    path = tmp_path / "train.jsonl.gz"
    cut_gzip(path, 3000)
    with pytest.raises(ValueError, match=rf"{path}: the gzip stream is damaged or cut short after line \d+"):
        reader(path)


@pytest.mark.parametrize("reader", [read_records, lambda path: load_records(path, ["text"])])
def test_a_gz_file_that_is_not_gzip_is_named(tmp_path, reader):
    """BadGzipFile ("Not a gzipped file (b'{"')"), naming no file."""
    path = tmp_path / "train.jsonl.gz"
    path.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=rf"{path}: the gzip stream is damaged or cut short before its first line"):
        reader(path)


def test_a_text_file_with_carriage_return_line_endings_reads_the_same_both_ways(tmp_path):
    """Old Mac OS line endings: `read_records` gave one record, `load_records` (the scripts' reader) three."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"one\rtwo\r\rthree\r\nfour\n")
    expected = ["one", "two", "three", "four"]
    assert [record["text"] for record in read_records(path)] == expected
    assert load_records(path, ["text"])["text"] == expected


def test_a_csv_with_carriage_return_line_endings_is_named_with_the_fix(tmp_path):
    """The error ended in Python's advice ("do you need to open the file in universal-newline mode?"), which a user
    of the scripts cannot follow."""
    path = tmp_path / "train.csv"
    path.write_bytes(b"text,label\rhi,1\ryo,2\r")
    with pytest.raises(ValueError, match=r"line 1: not valid CSV .*lone \\r .*`tr '\\r' '\\n'`") as error:
        read_records(path)
    assert "universal-newline" not in str(error.value)
    quoted = tmp_path / "quoted.csv"
    quoted.write_bytes(b'text,label\r\n"a\rb",1\r\nc,2\r\n')  # inside quotes a \r is text
    assert read_records(quoted)[0]["text"] == "a\rb"


@pytest.mark.parametrize(
    "labels", [["1", " 1", "2"], ["pos", "neg", "pos "], [["a"], ["a", " a"], ["b"]]], ids=["digits", "names", "multi"]
)
def test_labels_that_differ_only_in_whitespace_are_refused(labels):
    """A CSV written with ", " between fields gave "1" and " 1" as two classes, silently."""
    with pytest.raises(ValueError, match=r"differ only in the whitespace around them"):
        ClassificationLabels.from_splits({"train": labels}, "label")


# ---- output folders ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("link", [False, True])
def test_a_folder_is_never_written_over_a_file(tmp_path, link):
    """`write_folder` (every output folder of the package and scripts) replaced a file at its target with the new
    folder: `convert_rannet_checkpoint(..., "notes.txt", overwrite=True)` deleted the user's notes."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    target = notes
    if link:
        target = tmp_path / "output"
        target.symlink_to(notes)
    with pytest.raises(ValueError, match=r"is a file, not a folder: writing the output folder there would replace"):
        with write_folder(target, "saving") as staging:
            (staging / "config.json").write_text("{}")
    assert notes.read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", *(["output"] if link else [])])


def test_the_converter_does_not_replace_a_file_with_its_folder(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("where the checkpoint came from")
    with pytest.raises(ValueError, match=r"notes\.txt is a file, not a folder"):
        convert_rannet_checkpoint(RANNET_FIXTURE, notes, overwrite=True)
    assert notes.read_text() == "where the checkpoint came from"
    assert files_of(tmp_path) == {"notes.txt": b"where the checkpoint came from"}


# ---- heads and options that cannot go together, said at once ------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"cutoffs": [20, 40], "div_val": 2}, {"associative_memory": True}])
def test_a_prefix_lm_with_a_causal_only_option_names_the_prefix_lm(overrides):
    """RANForPrefixLM sets `is_causal=False` on the config it is given, and the config then asked the user, who had
    set `is_causal=True`, to "set `is_causal=True`"."""
    config = RANConfig(**TINY, min_window_size=2, is_causal=True, **overrides)
    name = next(iter(overrides))
    with pytest.raises(ValueError, match=rf"RANForPrefixLM reads its source both ways .*`{name}=.*RANForCausalLM"):
        RANForPrefixLM(config)
    assert config.is_causal


SALIENT_CELLS = {"is_causal": True, "memory_review_cells": 2, "memory_salient_cells": 1}


def test_the_exporter_refuses_salient_cells_at_once(tmp_path):
    """`export_onnx` traced the model for seconds, then raised a TorchExportError whose reason was buried in its
    "Exception summary"."""
    model = RANForCausalLM(RANConfig(**TINY, min_window_size=2, **SALIENT_CELLS))
    with pytest.raises(NotImplementedError, match=r"`memory_salient_cells` cannot be exported to ONNX"):
        export_onnx(model, tmp_path / "model.onnx")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("head", ["prefix", "memory"])
def test_the_export_script_refuses_what_cannot_be_exported_without_a_traceback(tmp_path, capsys, head):
    """`export_onnx.py` on a saved prefix LM ended in a NotImplementedError traceback."""
    import export_onnx as export_script

    if head == "prefix":
        model = RANForPrefixLM(RANConfig(**TINY, min_window_size=2))
    else:
        model = RANForCausalLM(RANConfig(**TINY, min_window_size=2, **SALIENT_CELLS))
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as exit_info:
        export_script.main(["--model_dir", str(tmp_path / "model"), "--output", str(tmp_path / "model.onnx")])
    assert exit_info.value.code == 1
    assert re.search(r"^error: .*model: RANFor\w+ .*cannot be exported to ONNX", capsys.readouterr().err, re.MULTILINE)
    assert not (tmp_path / "model.onnx").exists()


# ---- --config_overrides ---------------------------------------------------------------------------------------------


NAMED_CLASSES = {"num_labels": 2, "id2label": {0: "no", 1: "yes"}, "label2id": {"no": 0, "yes": 1}}


@pytest.mark.parametrize(
    "overrides, task_fields, named",
    [
        ("num_labels=5", NAMED_CLASSES, "num_labels"),
        ("problem_type=regression", {"problem_type": "single_label_classification"}, "problem_type"),
        ("is_causal=false", {"is_causal": True}, "is_causal"),
    ],
)
def test_config_overrides_of_what_the_script_sets_from_the_data_are_refused(wordpiece, overrides, task_fields, named):
    """`run_classification.py --config_overrides num_labels=5` on data of 2 classes saved a model of 5 outputs named
    LABEL_0..LABEL_4: the class names were lost, with no word."""
    from training_utils import ModelArguments, load_config

    arguments = ModelArguments(tokenizer_name="unused", config_overrides=f"hidden_size=16,{overrides}")
    message = rf"--config_overrides sets `{named}`, which the script sets itself .*leave it "
    with pytest.raises(ValueError, match=message):
        load_config(arguments, wordpiece, **task_fields)
    arguments = ModelArguments(tokenizer_name="unused", config_overrides="hidden_size=16")
    assert load_config(arguments, wordpiece, **task_fields).hidden_size == 16


def test_a_field_given_twice_in_the_overrides_is_named():
    config = RANConfig(**TINY, min_window_size=2)
    with pytest.raises(ValueError, match="`hidden_size` is given twice"):
        apply_config_overrides(config, "hidden_size=32,hidden_size=16")
    assert config.hidden_size == TINY["hidden_size"]  # nothing set


@pytest.mark.parametrize("fields", [{"cutoffs": [10, 20]}, {"associative_memory": True}])
def test_causal_only_options_on_an_encoder_point_to_the_causal_lm_not_to_flipping_the_head(fields):
    with pytest.raises(CONFIG_ERROR, match=r"belongs? to the causal LM \(`RANForCausalLM`, `run_clm.py`"):
        RANConfig(**TINY, min_window_size=2, **fields)


def test_a_cache_is_copied_as_documented_and_one_holding_a_graph_is_named():
    config = RANConfig(**TINY, min_window_size=2, is_causal=True)
    model = RANForCausalLM(config).eval()
    ids = torch.randint(1, config.vocab_size, (1, 9))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        copied = copy.deepcopy(cache)
        next_ids = torch.randint(1, config.vocab_size, (1, 3))
        continued, from_copy = (model(next_ids, past_key_values=c).logits for c in (cache, copied))
        assert torch.equal(continued, from_copy)
    with_graph = model(ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"holds the autograd graph.*torch.no_grad\(\)"):
        copy.deepcopy(with_graph)
    assert copy.deepcopy(with_graph.detach()).get_seq_length() == 9
