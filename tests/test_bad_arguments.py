"""Bad arguments, kept as regression tests and grouped by kind:

- a model given a cache it cannot continue, or a config changed after it was built;
- script flags out of range, refused before any tokenizer is trained, data read or model built;
- inputs that used to cost memory in proportion to their longest line, now read in pieces.
"""

import json
import random
import sys

import evaluate_perplexity
import lm_data
import pytest
import run_classification
import run_clm
import run_mlm
import run_ner
import run_pipeline
import run_summarization
import torch
import train_tokenizer
from data_loading import cut_for_tokenizer
from ran_testing import CONFIG_ERROR
from transformers import DynamicCache

from ran_hf import RANCache, RANConfig, RANForCausalLM
from ran_hf.files.text_files import split_before_whitespace


def tiny_causal_lm(**overrides) -> RANForCausalLM:
    fields = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8}
    fields |= {"window_size": 8, "min_window_size": 2, "is_causal": True}
    return RANForCausalLM(RANConfig(**{**fields, **overrides})).eval()


@pytest.fixture
def tokens():
    return torch.randint(1, 50, (2, 13), generator=torch.Generator().manual_seed(0))


# ---- model: a cache it cannot continue ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache, kind",
    [
        pytest.param(DynamicCache(), "DynamicCache", id="a transformer's cache"),
        pytest.param(((torch.zeros(2, 2, 13, 8),) * 2,), "tuple", id="legacy tuples"),
    ],
)
def test_a_cache_of_another_kind_is_refused(tokens, cache, kind):
    """Both failed with `AttributeError: ... has no attribute 'past_lengths'`."""
    with pytest.raises(TypeError, match=rf"`past_key_values` must be a RANCache .*got {kind}"):
        tiny_causal_lm()(tokens, past_key_values=cache)


@pytest.mark.parametrize(
    "other, named",
    [
        pytest.param({"num_hidden_layers": 2}, "num_hidden_layers 2 there, 1 here", id="more layers"),
        pytest.param({"hidden_size": 32, "head_dim": 16}, "hidden_size 32 there, 16 here", id="wider"),
        pytest.param({"window_size": 4}, "window_size 4 there, 8 here", id="other windows"),
        pytest.param({"memory_review_cells": 2}, "memory_review_cells 2 there, None here", id="bounded review"),
    ],
)
def test_a_cache_of_another_model_is_refused_naming_the_difference(tokens, other, named):
    with torch.no_grad():
        cache = tiny_causal_lm(**other)(tokens, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=rf"`past_key_values` was made by another model \(.*{named}"):
            tiny_causal_lm()(tokens, past_key_values=cache)


def test_a_cache_of_a_model_of_the_same_shape_continues(tokens):
    model = tiny_causal_lm()
    with torch.no_grad():
        whole = model(tokens).logits
        cache = model(tokens[:, :9], past_key_values=RANCache(model.config), use_cache=True).past_key_values
        continued = model(tokens[:, 9:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(continued, whole[:, 9:], atol=1e-5, rtol=1e-4)


# ---- model: a config changed after the model was built --------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value, message",
    [
        pytest.param("window_size", 0, r"(?s)field 'window_size'.*got 0", id="window_size 0"),
        pytest.param("window_overlap", -1, r"(?s)field 'window_overlap'.*got -1", id="negative overlap"),
        pytest.param(
            "hidden_dropout_prob", float("nan"), r"(?s)field 'hidden_dropout_prob'.*finite", id="nan dropout"
        ),
        pytest.param("cell_pooling", "median", r"(?s)field 'cell_pooling'.*expected one of", id="unknown pooling"),
    ],
)
def test_a_bad_value_set_on_a_built_models_config_is_refused_when_set(tokens, name, value, message):
    model = tiny_causal_lm()
    with pytest.raises(CONFIG_ERROR, match=message):
        setattr(model.config, name, value)
    assert model(tokens).logits.shape == (2, 13, 50)  # the config was left as it was


@pytest.mark.parametrize(
    "changes, message",
    [
        pytest.param(
            {"window_size": 4, "min_window_size": 6}, r"`min_window_size` \(6\) must be smaller", id="min over window"
        ),
        pytest.param({"memory_salient_cells": 2}, r"`memory_salient_cells` keeps cells", id="salient alone"),
    ],
)
def test_a_config_field_changed_after_building_is_checked_when_the_model_runs(tokens, changes, message):
    """A rule between fields is checked when the model runs (each field alone is checked when set)."""
    model = tiny_causal_lm()
    model(tokens)
    for name, value in changes.items():
        setattr(model.config, name, value)
    with pytest.raises(
        ValueError, match=rf"(?s)config was changed after the model was built and is not valid: .*{message}"
    ):
        model(tokens)


def test_a_valid_change_runs_and_a_fix_is_seen(tokens):
    model = tiny_causal_lm()
    model.config.window_size = 2  # not above `min_window_size`
    with pytest.raises(ValueError, match="window_size"):
        model(tokens)
    model.config.window_size = 4  # a valid value: the model runs with windows of 4
    with torch.no_grad():
        assert model(tokens).logits.shape == (2, 13, 50)


# ---- script flags out of range: refused when parsed, naming the flag ------------------------------------------------

NO_FILE = "not-read.txt"  # the flags are refused before any file is opened
SCRATCH = ["--tokenizer_name", "not-read", "--do_train"]


@pytest.mark.parametrize(
    "script, argv, message",
    [
        # Transformers' own training flags, unchecked there (a zero batch or step divided by zero or looped)
        (run_clm, ["--per_device_train_batch_size", "0"], r"--per_device_train_batch_size must be at least 1, got 0"),
        (run_clm, ["--gradient_accumulation_steps", "0"], r"--gradient_accumulation_steps must be at least 1, got 0"),
        (run_clm, ["--learning_rate", "-1"], r"--learning_rate must be more than 0, got -1"),
        (run_clm, ["--learning_rate", "nan"], r"--learning_rate must be a finite number, got nan"),
        (run_clm, ["--adam_beta1", "1.5"], r"--adam_beta1 must be at least 0 and less than 1, got 1.5"),
        (run_clm, ["--save_steps", "0"], r"--save_steps must be more than 0, got 0"),
        (run_clm, ["--seed", "-1"], r"--seed must be at least 0 and less than 4294967296, got -1"),
        (run_clm, ["--max_nonfinite_steps", "0"], r"--max_nonfinite_steps must be at least 1, got 0"),
        # the scripts' own
        (run_clm, ["--block_size", "1"], r"--block_size must be at least 2, got 1"),
        (run_clm, ["--preprocessing_num_workers", "0"], r"--preprocessing_num_workers must be at least 1, got 0"),
        (run_mlm, ["--mlm_probability", "0"], r"--mlm_probability must be more than 0 and less than 1, got 0"),
        (run_mlm, ["--pad_to_multiple_of", "0"], r"--pad_to_multiple_of must be at least 1, got 0"),
        (run_classification, ["--max_seq_length", "0"], r"--max_seq_length must be at least 1, got 0"),
        (run_classification, ["--multi_label_threshold", "1.5"], r"--multi_label_threshold must be more than 0 and"),
        (run_ner, ["--preprocessing_num_workers", "-2"], r"--preprocessing_num_workers must be at least 1, got -2"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_training_script_flags_out_of_range(script, argv, message, tmp_path):
    flags = SCRATCH + ["--train_file", NO_FILE, "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=message):
        script.main(flags + argv)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_beams", "0"], r"--num_beams must be at least 1, got 0"),
        (["--max_source_length", "2"], r"--max_source_length must be at least 3, got 2"),
        (["--max_eval_samples", "0"], r"--max_eval_samples must be at least 1, got 0"),
        (["--per_device_eval_batch_size", "0"], r"--per_device_eval_batch_size must be at least 1, got 0"),
    ],
)
def test_summarization_flags_out_of_range(argv, message, tmp_path):
    """Checked from the flags' declared ranges (`argument_checks.py`), as every other script's are."""
    (tmp_path / "train.jsonl").touch()  # the script checks that its files exist as it parses
    flags = [*SCRATCH, "--train_file", str(tmp_path / "train.jsonl"), "--title_from_first_line"]
    with pytest.raises(ValueError, match=message):
        run_summarization.main([*flags, "--output_dir", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()


def test_lora_flags_out_of_range(tmp_path):
    base = [
        "--model_name_or_path",
        "not-read",
        "--train_file",
        NO_FILE,
        "--output_dir",
        str(tmp_path),
        "--lora_r",
        "4",
    ]
    with pytest.raises(ValueError, match=r"--lora_dropout must be at least 0 and less than 1, got 1.0"):
        run_classification.main([*base, "--lora_dropout", "1.0"])
    with pytest.raises(ValueError, match=r"--lora_alpha must be more than 0, got 0"):
        run_classification.main([*base, "--lora_alpha", "0"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min_frequency", "-1"], r"--min_frequency must be at least 0, got -1"),
        (["--max_documents", "0"], r"--max_documents must be at least 1, got 0"),
        (["--model_max_length", "0"], r"--model_max_length must be at least 1, got 0"),
    ],
)
def test_tokenizer_flags_out_of_range(argv, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        train_tokenizer.main(["--train_files", NO_FILE, "--output_dir", str(tmp_path / "tok"), *argv])
    assert not (tmp_path / "tok").exists()


def test_perplexity_chunk_length_out_of_range():
    with pytest.raises(ValueError, match=r"--chunk_length must be at least 2, got 1"):
        evaluate_perplexity.main(["--model_name_or_path", "not-read", "--text_file", NO_FILE, "--chunk_length", "1"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_queries", "0"], r"--num_queries must be at least 1, got 0"),
        (["--max_seq_length", "1"], r"--max_seq_length must be at least 2, got 1"),
        (["--per_device_train_batch_size", "0"], r"--per_device_train_batch_size must be at least 1, got 0"),
    ],
)
def test_embedding_flags_out_of_range(argv, message, tmp_path):
    pytest.importorskip("sentence_transformers")
    import train_embeddings

    files = ["--train_file", NO_FILE, "--test_file", NO_FILE, "--tokenizer_name", "not-read"]
    with pytest.raises(ValueError, match=message):
        train_embeddings.main([*files, "--output_dir", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch_size", "0"], r"--batch_size must be at least 1, got 0"),
        (["--dropout", "nan"], r"--dropout must be a finite number, got nan"),
        (["--dropout", "1"], r"--dropout must be at least 0 and less than 1, got 1.0"),
        (["--window_size", "1"], r"--window_size must be at least 2, got 1"),
        (["--mlm_epochs", "0"], r"--mlm_epochs must be more than 0, got 0.0"),
        (["--vocab_size", "5"], r"--vocab_size must be at least 6, got 5"),
        (["--num_attention_heads", "3"], r"--hidden_size \(64\) must be a multiple of --num_attention_heads \(3\)"),
        (["--hidden_size", "12", "--num_attention_heads", "4"], r"give no valid model: `head_dim` must be even"),
        (["--synthetic_documents", "600,0,150"], r"--synthetic_documents must be three positive counts"),
        (["--train_file", NO_FILE], rf"--train_file {NO_FILE} does not exist"),
        # a flag only the fine-tuning step reads: refused before the tokenizer is trained and the MLM pretrained
        (["--learning_rate", "-0.1"], r"--learning_rate must be more than 0, got -0.1"),
    ],
)
def test_pipeline_checks_every_flag_before_its_first_step(argv, message, tmp_path):
    """`run_pipeline.py` used to find these only after training the tokenizer and pretraining the model."""
    with pytest.raises(ValueError, match=message):
        run_pipeline.main(["--output_dir", str(tmp_path / "pipeline"), *argv])
    assert not (tmp_path / "pipeline").exists()  # no data written, no tokenizer trained


@pytest.mark.parametrize("below", ["", "pipeline"], ids=["the-file", "a-folder-below-it"])
def test_pipeline_output_dir_on_a_file_is_named_before_any_work(below, tmp_path):
    """It was a raw `NotADirectoryError` from inside the data step."""
    file = tmp_path / "taken"
    file.write_text("a user's file")
    output_dir = file / below if below else file
    with pytest.raises(ValueError, match=rf"--output_dir {output_dir}: {file} is a file"):
        run_pipeline.main(["--output_dir", str(output_dir)])
    assert file.read_text() == "a user's file"


def test_pipeline_checks_its_steps_flags_before_its_first_step(tmp_path, monkeypatch):
    """A flag the pipeline passes on, refused by a later step's own parser, stops it before the first step."""
    real_parse = run_pipeline.parse_arguments
    seen = []

    def parse_and_refuse_fine_tuning(types, argv):
        seen.append(argv)
        if "--model_name_or_path" in argv:
            raise ValueError("refused by the fine-tuning step")
        return real_parse(types, argv)

    monkeypatch.setattr(run_pipeline, "parse_arguments", parse_and_refuse_fine_tuning)
    with pytest.raises(ValueError, match="refused by the fine-tuning step"):
        run_pipeline.main(["--output_dir", str(tmp_path / "pipeline")])
    assert not (tmp_path / "pipeline").exists()
    assert len(seen) == 3  # the pipeline's, the MLM step's, the fine-tuning step's


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch_size", "0"], "argument --batch_size: must be at least 1, got 0"),
        (["--tolerance", "nan"], "argument --tolerance: must be a finite number, got nan"),
        (["--opset_version", "0"], "argument --opset_version: must be at least 1, got 0"),
        (["--batch_size", "two"], "argument --batch_size: invalid int value: 'two'"),
    ],
)
def test_export_flags_out_of_range(argv, message, tmp_path, capsys):
    import export_onnx

    with pytest.raises(SystemExit):
        export_onnx.main(["--model_dir", str(tmp_path), "--output", str(tmp_path / "model.onnx"), *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--window_size", "8"], "argument --window_size: must be more than 8, got 8"),
        (["--vocab_size", "5"], "argument --vocab_size: must be more than 5, got 5"),
        # a device that exists but is no regular file: it was said not to exist
        (["--text_file", "/dev/null"], "--text_file /dev/null holds no text"),
        (["--text_file", "/"], "--text_file / is a folder"),
    ],
)
def test_quickstart_flags_out_of_range(argv, message, monkeypatch, capsys):
    import quickstart

    monkeypatch.setattr(sys, "argv", ["quickstart.py", *argv])
    with pytest.raises(SystemExit):
        quickstart.main()
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, argv, message",
    [
        # was "statistics.StatisticsError: no median for empty data", after the scans had run
        ("benchmark_scan", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        ("benchmark_speed", ["--threads", "0"], "argument --threads: must be at least 1, got 0"),
        ("benchmark_compile", ["--lengths", "160", "0"], "argument --lengths: must be at least 1, got 0"),
        ("benchmark_summarization", ["--learning_rate", "-1"], "argument --learning_rate: must be more than 0"),
        ("benchmark_kernels", ["--gpu_memory_gib", "-1"], "argument --gpu_memory_gib: must be at least 0"),
        ("diagnose_recall", ["--batch_size", "0"], "argument --batch_size: must be at least 1, got 0"),
        ("tune_triton_scan", ["--dropout", "1"], "argument --dropout: must be at least 0 and less than 1"),
        ("benchmark_data_loading", ["--first", "0"], "argument --first: must be at least 1, got 0"),
    ],
)
def test_benchmark_flags_out_of_range(script, argv, message, monkeypatch, capsys):
    """The benchmarks' numeric flags took any value; a zero count measured nothing and failed at the end."""
    module = pytest.importorskip(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit):
        module.parse_args(argv) if hasattr(module, "parse_args") else module.main()
    assert message in capsys.readouterr().err


# ---- bounded memory: long lines read in pieces ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers():
    """A WordPiece and a byte-level BPE tokenizer, trained on a few lines."""
    lines = [f"the {word} reads long documents , window by window ; it's {index} times" for index, word in
             enumerate(["model", "network", "reader", "cell", "memory"] * 20)]  # fmt: skip
    built = {}
    for kind in ("wordpiece", "bpe"):
        arguments = train_tokenizer.TokenizerArguments(train_files=[], output_dir="", model=kind, vocab_size=300)
        built[kind] = train_tokenizer.build_tokenizer(arguments, lines)
    return built


def long_line(characters: int) -> str:
    words = ["the", "model", "reads", "documents,", "window", "by", "window;", "it's", "42", "times", "  "]
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(characters // 4))
    return text[:characters].strip()


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_a_long_line_tokenized_in_pieces_gives_the_whole_lines_tokens(tokenizers, kind, monkeypatch):
    tokenizer = tokenizers[kind]
    text = long_line(300_000)
    read = []
    real_call = type(tokenizer).__call__

    def counting_call(self, texts, *args, **kwargs):
        read.append(sum(map(len, texts)) if isinstance(texts, list) else len(texts))
        return real_call(self, texts, *args, **kwargs)

    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(type(tokenizer), "__call__", counting_call)
    (pieces,) = lm_data.token_ids(tokenizer, [text])
    assert pieces.tolist() == whole
    assert max(read[1:]) <= lm_data.CALL_CHARACTERS < len(text)  # read[0]: the special-token probe, if any
    (wrapped,) = lm_data.token_ids(tokenizer, [text], special_tokens=True)
    monkeypatch.undo()
    assert wrapped.tolist() == tokenizer(text)["input_ids"]


def test_pieces_are_cut_before_whitespace_and_bounded():
    text = long_line(200_000) + " " + "x" * 70_000  # a run longer than a piece, without whitespace
    pieces = split_before_whitespace(text, characters=1 << 14)
    assert "".join(pieces) == text
    assert max(map(len, pieces)) <= 1 << 14
    assert all(piece[0].isspace() for piece in pieces[1:] if not piece.startswith("x"))


def test_a_document_without_whitespace_is_cut_before_tokenizing(tokenizers, monkeypatch):
    """A 50 MB document without whitespace took 3.3 GB and 150 s to keep 256 tokens: it was tokenized whole."""
    tokenizer = tokenizers["wordpiece"]
    text = "abcdefghij" * 500_000  # 5 MB, one "word"
    longest = []
    real_call = type(tokenizer).__call__

    def measuring_call(self, texts, *args, **kwargs):
        longest.append(max(map(len, texts)) if isinstance(texts, list) else len(texts))
        return real_call(self, texts, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", measuring_call)
    (cut,) = cut_for_tokenizer(tokenizer, [text], max_length=256)
    assert len(cut) <= 256 * (256 + 16) < len(text)
    assert max(longest) <= len(cut)
    monkeypatch.undo()
    assert tokenizer(cut, truncation=True, max_length=256)["input_ids"] == tokenizer(text[:100_000])["input_ids"]


def test_the_tokenizer_trainer_reads_a_long_line_in_pieces(monkeypatch, tmp_path):
    """The trainer held a 20 MB line read whole at 1.8 GB; it now reads pieces of TRAINING_PIECE_CHARACTERS."""
    text = long_line(100_000)
    read = []
    real_train = train_tokenizer.Tokenizer.train_from_iterator

    def recording_train(self, iterator, *args, **kwargs):
        pieces = list(iterator)
        read.extend(pieces)
        return real_train(self, pieces, *args, **kwargs)

    monkeypatch.setattr(train_tokenizer.Tokenizer, "train_from_iterator", recording_train)
    (tmp_path / "line.txt").write_text(text + "\n", encoding="utf-8")
    train_tokenizer.main(
        ["--train_files", str(tmp_path / "line.txt"), "--vocab_size", "100", "--output_dir", str(tmp_path / "tok")]
    )
    assert "".join(read) == text and max(map(len, read)) <= train_tokenizer.TRAINING_PIECE_CHARACTERS


def test_embedding_documents_are_cut_to_what_the_models_read(tokenizers, tmp_path):
    """`train_embeddings.py` tokenized every document whole (the token statistics, sentence-transformers before it
    truncates): a long one-line document cost some 150 bytes a character. Now a text is cut to a part that still
    gives more tokens than any model reads, and so gives the same first tokens."""
    pytest.importorskip("sentence_transformers")
    import train_embeddings

    text = long_line(400_000)
    path = tmp_path / "documents.jsonl"
    path.write_text(json.dumps({"text": text, "label": "long"}) + "\n" + json.dumps({"text": "short", "label": "x"}))
    data_args = train_embeddings.DataTrainingArguments(train_file=str(path), test_file=str(path), strip_headers=False)
    tokenizer = tokenizers["wordpiece"]
    (cut, labels), short = train_embeddings.read_documents(str(path), data_args, tokenizer, max_tokens=256)
    assert labels == {"long"} and short == ("short", frozenset({"x"}))
    assert len(cut) <= 256 * (256 + 16) < len(text)
    first = tokenizer(cut, truncation=True, max_length=256)["input_ids"]
    assert first == tokenizer(text[:50_000], truncation=True, max_length=256)["input_ids"]


def test_quickstart_reads_only_the_start_of_a_long_text(tmp_path):
    """`quickstart.py` read a whole file and ran all of it through the model as one sequence: memory grew with the
    file (0.4 MB of one line: 72,708 tokens, 1.0 GB). It now reads the characters its --max_tokens need."""
    import quickstart

    path = tmp_path / "one-line.txt"
    path.write_text(long_line(1_000_000), encoding="utf-8")
    (line,), more = quickstart.read_text(path, characters=10_000)
    assert more and len(line) <= 10_000 and path.read_text().startswith(line)
    (line,), more = quickstart.read_text(path, characters=2_000_000)
    assert not more and line == path.read_text().strip()


@pytest.mark.parametrize("encoding", ["utf-16", "cp1252"])
def test_quickstart_names_the_encoding_of_a_text_that_is_not_utf8(tmp_path, encoding):
    """quickstart.py said only "convert it to UTF-8"; it names what the data scripts name: the encoding (UTF-16 by its
    byte-order mark, a byte-wide one as a guess) and the iconv command that converts the file."""
    import quickstart

    path = tmp_path / "notes.txt"
    path.write_text("Café au lait, déjà vu.\nA second line.\n", encoding=encoding)
    expected = (
        "is UTF-16 text.*iconv -f UTF-16" if encoding == "utf-16" else "not valid UTF-8.*iconv -f CP1252.*a guess"
    )
    with pytest.raises(ValueError, match=rf"notes.txt.*{expected}"):
        quickstart.read_text(path, characters=10_000)


@pytest.mark.parametrize("name,field", [("is_casual", "is_causal"), ("hidden_szie", "hidden_size")])
def test_a_field_with_two_neighbouring_letters_swapped_is_named(name, field):
    """`RANConfig(is_casual=True)` made an encoder without a word: difflib scores a swap of two letters below the
    cutoff that catches other misspellings. Refused when the config is made and when it is set."""
    from ran_hf import RANConfig

    with pytest.raises(ValueError, match=rf"`{name}` is not a field of RANConfig \(did you mean '{field}'\?\)"):
        RANConfig(**{name: True})
    config = RANConfig()
    with pytest.raises(ValueError, match=rf"did you mean '{field}'"):
        setattr(config, name, True)


def test_save_pretrained_to_a_file_path_is_refused_and_the_file_kept(tmp_path):
    """Transformers logs a line, saves nothing and returns normally: the caller believes the model saved."""
    from ran_testing import tiny_config

    from ran_hf import RANModel

    target = tmp_path / "notes.txt"
    target.write_text("kept")
    with pytest.raises(NotADirectoryError, match="notes.txt is a file: `save_pretrained` writes a folder"):
        RANModel(tiny_config()).save_pretrained(target)
    assert target.read_text() == "kept"


@pytest.mark.parametrize("num_labels", [-2, 0])
def test_a_bad_num_labels_is_named_as_given(num_labels):
    """`num_labels=-2` was reported as "got 0": Transformers keeps the count as `id2label`, of length 0."""
    from ran_hf import RANConfig

    with pytest.raises(ValueError, match=rf"`num_labels` must be >= 1, got {num_labels}:"):
        RANConfig(num_labels=num_labels)
    with pytest.raises(ValueError, match=rf"got {num_labels}:"):
        RANConfig().num_labels = num_labels
