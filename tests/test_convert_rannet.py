"""Converting official RAN checkpoints (TensorFlow `rannet`): parity with rannet's outputs and tokenizer, the written
folder, errors on bad input, and loading the result as remote code where `ran_hf` is not installed.

The references were computed by rannet 0.3.1 itself (`scripts/rannet_tf/make_rannet_fixtures.py`, see
`tests/fixtures/rannet/README.md`); no TensorFlow is needed here.
"""

import gzip
import hashlib
import json
import logging
import os
import re
import runpy
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ran_testing import pad_batch
from remote_code import run_without_ran_hf
from safetensors.torch import load_file
from tf_checkpoint_writer import write_checkpoint
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from ran_hf import RANForMaskedLM, convert_rannet_checkpoint
from ran_hf.files.tf_checkpoint import TFCheckpointReader
from ran_hf.integrations.convert_rannet import build_rannet_tokenizer, rannet_config_to_ran_config


FIXTURES = Path(__file__).parent / "fixtures" / "rannet"
SCRIPT = Path(__file__).parents[1] / "scripts" / "convert_rannet_checkpoint.py"
TOLERANCE = 1e-4  # float32 against float32 (measured: under 1e-5)

# (folder to convert, folder whose expected.npz holds rannet's outputs for it)
CHECKPOINTS = [
    pytest.param("l1_d32_w4_last", "l1_d32_w4_last", id="1-layer-last"),
    pytest.param("l2_d24_w6_mean", "l2_d24_w6_mean", id="2-layers-mean"),
    pytest.param("l3_d16_w8_max", "l3_d16_w8_max", id="3-layers-max"),
    pytest.param("l3_d16_w8_max_training", "l3_d16_w8_max", id="3-layers-max-training-names"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every fixture checkpoint converted once: {fixture name: converted folder}."""
    root = tmp_path_factory.mktemp("converted")
    return {
        name: convert_rannet_checkpoint(FIXTURES / name, root / name)
        for name in ("l1_d32_w4_last", "l2_d24_w6_mean", "l3_d16_w8_max", "l3_d16_w8_max_training")
    }


def load_expected(name):
    with np.load(FIXTURES / name / "expected.npz") as expected:
        return {key: expected[key] for key in expected.files}


def expected_cases(expected):
    """(input ids, token slice, case index) of every case: one unpadded sequence each."""
    offsets = expected["offsets"]
    return [
        (
            torch.from_numpy(expected["input_ids"][offsets[k] : offsets[k + 1]]).long(),
            slice(offsets[k], offsets[k + 1]),
            k,
        )
        for k in range(len(offsets) - 1)
    ]


def run_model(model, input_ids, attention_mask=None):
    with torch.no_grad():
        encoded = model.model(input_ids=input_ids, attention_mask=attention_mask)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return {
        "token_states": encoded.last_hidden_state,
        "mlm_logits": logits,
        "last_cell": encoded.last_cell,
        "pooled_cell": encoded.pooled_cell,
    }


def differences(actual, expected, tokens, case, positions=slice(None), row=0):
    """Ours minus rannet's, per output, for one sequence (row `row` of a batch, its real tokens at `positions`)."""
    return {
        "token_states": actual["token_states"][row, positions] - torch.from_numpy(expected["token_states"][tokens]),
        "mlm_logits": actual["mlm_logits"][row, positions] - torch.from_numpy(expected["mlm_logits"][tokens]),
        "last_cell": actual["last_cell"][row] - torch.from_numpy(expected["last_cell"][case]),
        "pooled_cell": actual["pooled_cell"][row] - torch.from_numpy(expected["pooled_cell"][case]),
    }


# --------------------------------------------------------------------------------------------------------------------
# Numerical parity with rannet
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, reference", CHECKPOINTS)
def test_outputs_match_rannet(converted, name, reference):
    """Token states (last layer), last cell, pooled cell and MLM logits of every window case, unpadded."""
    model = RANForMaskedLM.from_pretrained(converted[name])
    expected = load_expected(reference)
    worst = dict.fromkeys(("token_states", "mlm_logits", "last_cell", "pooled_cell"), 0.0)
    for input_ids, tokens, case in expected_cases(expected):
        for key, difference in differences(run_model(model, input_ids[None]), expected, tokens, case).items():
            worst[key] = max(worst[key], difference.abs().max().item())
    assert all(value <= TOLERANCE for value in worst.values()), worst


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["l1_d32_w4_last", "l2_d24_w6_mean", "l3_d16_w8_max"])
def test_padded_batches_match_rannet_per_sequence(converted, name, side):
    """All cases in one padded batch: each sequence gets what rannet gives for it alone."""
    model = RANForMaskedLM.from_pretrained(converted[name])
    expected = load_expected(name)
    cases = expected_cases(expected)
    input_ids, attention_mask = pad_batch([ids for ids, _, _ in cases], side=side)
    actual = run_model(model, input_ids, attention_mask)
    for row, (_, tokens, case) in enumerate(cases):
        positions = attention_mask[row].bool()
        for key, difference in differences(actual, expected, tokens, case, positions, row).items():
            assert difference.abs().max().item() <= TOLERANCE, (case, key)


def test_training_checkpoint_converts_to_the_same_weights(converted):
    """rannet's pretraining naming (Keras `save_weights`) gives exactly the weights of the official naming."""
    official = load_file(converted["l3_d16_w8_max"] / "model.safetensors")
    training = load_file(converted["l3_d16_w8_max_training"] / "model.safetensors")
    assert official.keys() == training.keys()
    for key, tensor in official.items():
        assert torch.equal(training[key], tensor), key


def test_optimizer_state_in_a_training_checkpoint_is_ignored(tmp_path, converted):
    """Optimizer slots and counters, as `ModelCheckpoint` saves them during training, are skipped."""
    source = FIXTURES / "l3_d16_w8_max_training"
    reader = TFCheckpointReader(source / "01.weights")
    tensors = {name: reader.read(name) for name, entry in reader.entries.items() if entry.dtype != "string"}
    slots = {
        name.replace("/.ATTRIBUTES/", "/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/"): np.zeros_like(value)
        for name, value in tensors.items()
    }
    tensors.update(slots)
    tensors["optimizer/iter/.ATTRIBUTES/VARIABLE_VALUE"] = np.int64(1000)
    folder = tmp_path / "training"
    folder.mkdir()
    for file in ("config.json", "vocab.txt"):
        shutil.copy(source / file, folder)
    write_checkpoint(folder / "02.weights", tensors)
    output = convert_rannet_checkpoint(folder, tmp_path / "converted")
    converted_weights = load_file(output / "model.safetensors")
    for key, tensor in load_file(converted["l3_d16_w8_max"] / "model.safetensors").items():
        assert torch.equal(converted_weights[key], tensor), key


# --------------------------------------------------------------------------------------------------------------------
# The written folder
# --------------------------------------------------------------------------------------------------------------------


def test_converted_folder_holds_config_weights_code_tokenizer_and_card(converted):
    folder = converted["l2_d24_w6_mean"]
    files = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_ran.py", "modeling_ran.py", "tokenizer.json"} <= files
    assert {"tokenizer_config.json", "README.md"} <= files
    assert not [name for name in files if name.startswith(".")]

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["RANForMaskedLM"]
    assert config["auto_map"]["AutoModelForMaskedLM"] == "modeling_ran.RANForMaskedLM"
    official = json.loads((FIXTURES / "l2_d24_w6_mean" / "config.json").read_text())
    mapped = {
        "vocab_size": official["vocab_size"],
        "hidden_size": official["embedding_size"],
        "num_hidden_layers": official["ran_layers"],
        "num_attention_heads": official["head_num"],
        "head_dim": official["head_size"],
        "window_size": official["window_size"],
        "min_window_size": official["min_window_size"],
        "cell_pooling": official["cell_pooling"],
        "hidden_dropout_prob": official["dropout_rate"],
        "attention_probs_dropout_prob": official["dropout_rate"],
        "initializer_range": official["kernel_initializer_range"],
        "memory_review": True,
        "pad_token_id": 0,
    }
    assert {key: config[key] for key in mapped} == mapped
    assert "kernel_initializer" not in config and "embedding_initializer" not in config

    card = (folder / "README.md").read_text()
    assert card.startswith("---\n") and "license: unknown" in card
    assert "trust_remote_code=True" in card and "2306.06843" in card
    assert "## This conversion" in card and "| cell pooling | mean |" in card
    assert re.search(r"`model\.ckpt\.index`: `[0-9a-f]{64}`", card)


def test_missing_official_keys_take_rannet_defaults():
    """`RanNetParams` defaults; the initializer kinds are accepted and dropped."""
    kwargs = rannet_config_to_ran_config({"vocab_size": 100, "kernel_initializer": "glorot_normal"})
    assert kwargs == {
        "vocab_size": 100,
        "hidden_size": 512,
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "num_hidden_layers": 2,
        "head_dim": 128,
        "num_attention_heads": 8,
        "window_size": 256,
        "min_window_size": 16,
        "cell_pooling": "last",
        "initializer_range": 0.02,
    }


@pytest.mark.parametrize(
    "auto_class, fresh_prefixes",
    [
        pytest.param(
            AutoModelForSequenceClassification, ("model.pooler.", "classifier."), id="sequence-classification"
        ),
        pytest.param(AutoModelForTokenClassification, ("classifier.",), id="token-classification"),
    ],
)
def test_other_heads_load_the_encoder_and_start_their_own_layers_fresh(converted, auto_class, fresh_prefixes):
    folder = converted["l2_d24_w6_mean"]
    model, info = auto_class.from_pretrained(folder, num_labels=3, output_loading_info=True)
    assert info["missing_keys"] and all(key.startswith(fresh_prefixes) for key in info["missing_keys"])
    assert all(key.startswith(("head.", "decoder.")) for key in info["unexpected_keys"])
    masked_lm = AutoModelForMaskedLM.from_pretrained(folder)
    for name, tensor in masked_lm.model.state_dict().items():
        assert torch.equal(model.model.state_dict()[name], tensor), name


def test_without_memory_review_the_output_layernorm_is_used(tmp_path):
    """The official variant without memory review keeps one `output-layernorm` per layer."""
    folder = tmp_path / "rannet"
    shutil.copytree(FIXTURES / "l1_d32_w4_last", folder)
    reader = TFCheckpointReader(folder / "model.ckpt")
    tensors = {name: reader.read(name) for name in reader.entries if "/output-attn/" not in name}
    rng = np.random.default_rng(0)
    gamma, beta = rng.normal(size=(2, 32)).astype(np.float32)
    tensors.update({"rannet/ran-0/output-layernorm/gamma": gamma, "rannet/ran-0/output-layernorm/beta": beta})
    write_checkpoint(folder / "model.ckpt", tensors)
    model = RANForMaskedLM.from_pretrained(convert_rannet_checkpoint(folder, tmp_path / "converted"))
    assert not model.config.memory_review
    assert torch.equal(model.model.layers[0].output_norm.weight, torch.from_numpy(gamma))
    assert torch.equal(model.model.layers[0].output_norm.bias, torch.from_numpy(beta))


def test_command_line(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT), run_name="convert_rannet_checkpoint")["main"]
    output = tmp_path / "out"
    main(["--rannet_dir", str(FIXTURES / "l1_d32_w4_last"), "--output_dir", str(output)])
    assert (output / "model.safetensors").is_file()
    assert str(output) in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--rannet_dir", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "other")])
    assert exit_info.value.code == 1
    assert "folder not found" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer parity
# --------------------------------------------------------------------------------------------------------------------


def tokenizer_cases():
    with (FIXTURES / "tokenizer" / "cases.jsonl").open(encoding="utf-8") as file:
        return [json.loads(line) for line in file]


@pytest.fixture(scope="module")
def fixture_tokenizer(tmp_path_factory):
    """The converter's tokenizer for the tokenizer fixture's vocabulary, saved and loaded back with AutoTokenizer."""
    folder = tmp_path_factory.mktemp("tokenizer")
    build_rannet_tokenizer(FIXTURES / "tokenizer" / "vocab.txt").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_tokenizer_matches_rannet_on_hand_written_text(fixture_tokenizer):
    """Accents, other scripts, numbers, URLs, control characters, emoji, over-long words, special tokens, pairs."""
    cases = [case for case in tokenizer_cases() if "source" not in case]
    assert len(cases) >= 20
    for case in cases:
        ids = fixture_tokenizer(case["text"], case.get("pair"))["input_ids"]
        assert ids == case["ids"], case["text"]


def read_sources(data_dir, cases):
    """{(source, index): text} for the records and sentences of the benchmark data that the cases refer to."""
    wanted = {}
    for case in cases:
        wanted.setdefault(case["source"], set()).add(case["index"])
    texts = {}
    for source, indices in wanted.items():
        path = data_dir / source
        if source.endswith(".jsonl.gz"):
            with gzip.open(path, "rt", encoding="utf-8") as file:
                for index, line in enumerate(file):
                    if index in indices:
                        texts[source, index] = json.loads(line)["text"]
                    if index >= max(indices):
                        break
        else:  # CoNLL: sentences as words joined by spaces, -DOCSTART- blocks skipped
            blocks = path.read_text(encoding="utf-8").split("\n\n")
            sentences = [[line.split(" ")[0] for line in block.splitlines() if line.strip()] for block in blocks]
            sentences = [" ".join(words) for words in sentences if words and words[0] != "-DOCSTART-"]
            texts.update({(source, index): sentences[index] for index in indices})
    return texts


@pytest.mark.needs_data("conll2003", "20newsgroups", "eurlex57k")
def test_tokenizer_matches_rannet_on_real_sentences(fixture_tokenizer, data_dir):
    """Sentences of CoNLL-2003, 20 Newsgroups and EURLEX-57K (read from the shared data, which is not committed)."""
    cases = [case for case in tokenizer_cases() if "source" in case]
    texts = read_sources(data_dir, cases)
    mismatches = []
    for case in cases:
        text = texts[case["source"], case["index"]][case["start"] : case["end"]]
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        assert digest == case["sha256"], f"{case['source']} #{case['index']} is not the text rannet read"
        if fixture_tokenizer(text)["input_ids"] != case["ids"]:
            mismatches.append(text)
    assert len(cases) >= 300
    assert not mismatches, mismatches[:3]


def test_converted_tokenizer(converted):
    """The converted folder's tokenizer: rannet's ids, [PAD] = 0, no special tokens around a single sequence."""
    tokenizer = AutoTokenizer.from_pretrained(converted["l1_d32_w4_last"])
    expected = load_expected("l1_d32_w4_last")
    encoded = tokenizer(str(expected["text"]))
    assert encoded["input_ids"] == expected["text_ids"].tolist()
    assert set(encoded) == {"input_ids", "attention_mask"}  # RAN has no segment embedding
    assert tokenizer.pad_token_id == 0 and tokenizer.convert_ids_to_tokens(0) == "[PAD]"
    assert tokenizer("[MASK]")["input_ids"] == [tokenizer.mask_token_id]
    sep = tokenizer.sep_token_id
    first, second = tokenizer("they")["input_ids"], tokenizer("she")["input_ids"]
    assert tokenizer("they", "she")["input_ids"] == first + [sep] + second + [sep]
    batch = tokenizer(["they walked", "she"], padding=True)
    assert batch["input_ids"][1][-1] == 0 and batch["attention_mask"][1] == [1, 0, 0]


# --------------------------------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing written
# --------------------------------------------------------------------------------------------------------------------


def edit_json(path, edit):
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def edit_lines(path, edit):
    lines = path.read_text().splitlines()
    edit(lines)
    path.write_text("\n".join(lines) + "\n")


def edit_checkpoint(folder, edit):
    reader = TFCheckpointReader(folder / "model.ckpt")
    tensors = {name: reader.read(name) for name in reader.entries}
    edit(tensors)
    write_checkpoint(folder / "model.ckpt", tensors)


def flip_byte(path, position):
    content = bytearray(path.read_bytes())
    content[position] ^= 0xFF
    path.write_bytes(bytes(content))


Q_KERNEL = "rannet/ran-0/encode-attn/dense-q/kernel"


def flip_tensor_byte(folder, name):
    """One flipped byte inside a tensor's data: finite, plausible weights unless the checksum is verified."""
    entry = TFCheckpointReader(folder / "model.ckpt").entries[name]
    flip_byte(folder / "model.ckpt.data-00000-of-00001", entry.offset + 2)


BAD_INPUTS = [
    pytest.param(lambda f: shutil.rmtree(f), FileNotFoundError, r"folder not found: .*rannet", id="missing-folder"),
    pytest.param(lambda f: (f / "config.json").unlink(), FileNotFoundError, r"config\.json not found", id="no-config"),
    pytest.param(lambda f: (f / "vocab.txt").unlink(), FileNotFoundError, r"vocab\.txt not found", id="no-vocab"),
    pytest.param(
        lambda f: [(f / name).unlink() for name in ("checkpoint", "model.ckpt.index")],
        FileNotFoundError,
        r"expected one TensorFlow checkpoint .*found none",
        id="no-checkpoint",
    ),
    pytest.param(lambda f: (f / "model.ckpt.index").unlink(), FileNotFoundError, r"model\.ckpt\.index", id="no-index"),
    pytest.param(
        lambda f: (f / "model.ckpt.data-00000-of-00001").unlink(),
        FileNotFoundError,
        r"model\.ckpt\.data-00000-of-00001",
        id="no-data",
    ),
    pytest.param(
        lambda f: flip_byte(f / "model.ckpt.index", 200),
        ValueError,
        r"model\.ckpt\.index: block checksum",
        id="damaged",
    ),
    pytest.param(
        lambda f: flip_tensor_byte(f, Q_KERNEL),
        ValueError,
        rf"model\.ckpt\.data-00000-of-00001: tensor '{Q_KERNEL}' fails its checksum",
        id="damaged-data",
    ),
    pytest.param(
        lambda f: (f / "config.json").write_text("{"), ValueError, r"config\.json: not valid JSON", id="bad-json"
    ),
    pytest.param(
        lambda f: edit_json(f / "config.json", lambda c: c.update(use_rope=True)),
        ValueError,
        r"config\.json: unknown key\(s\) 'use_rope'",
        id="unknown-config-key",
    ),
    pytest.param(
        lambda f: edit_json(f / "config.json", lambda c: c.pop("vocab_size")),
        ValueError,
        r"config\.json: the required key 'vocab_size'",
        id="no-vocab-size",
    ),
    pytest.param(
        lambda f: edit_json(f / "config.json", lambda c: c.update(min_window_size=4)),
        ValueError,
        r"config\.json: .*min_window_size",
        id="bad-config-value",
    ),
    pytest.param(
        lambda f: edit_json(f / "config.json", lambda c: c.update(head_size=7)),
        ValueError,
        r"config\.json: `head_size` must be even",
        id="odd-head-size",
    ),
    pytest.param(
        lambda f: edit_checkpoint(f, lambda t: t.pop(Q_KERNEL)),
        ValueError,
        rf"model\.ckpt\.index: variable '{Q_KERNEL}' is missing",
        id="missing-variable",
    ),
    pytest.param(
        lambda f: edit_checkpoint(f, lambda t: t.pop("rannet/ran-0/cell-initializer/kernel")),
        ValueError,
        r"'rannet/ran-0/cell-initializer/kernel' is missing",
        id="missing-cell-initializer",
    ),
    pytest.param(
        lambda f: edit_checkpoint(f, lambda t: t.update({Q_KERNEL: t[Q_KERNEL].T.copy()})),
        ValueError,
        rf"variable '{Q_KERNEL}' has shape \(16, 32\), expected \(32, 16\)",
        id="wrong-shape",
    ),
    pytest.param(
        lambda f: edit_checkpoint(f, lambda t: t.update({"rannet/output-cell-dense/kernel": np.zeros((32, 32))})),
        ValueError,
        r"unexpected variable\(s\) 'rannet/output-cell-dense/kernel'",
        id="unexpected-variable",
    ),
    pytest.param(
        lambda f: edit_lines(f / "vocab.txt", lambda lines: lines.append("zebra")),
        ValueError,
        r"vocab\.txt: the vocabulary has 61 tokens, but rannet/token-embedding/embeddings .* has 60 rows",
        id="vocab-larger-than-embedding",
    ),
    pytest.param(
        lambda f: edit_json(f / "config.json", lambda c: c.update(vocab_size=61)),
        ValueError,
        r"'rannet/token-embedding/embeddings' has shape \(60, 32\), expected \(61, 32\)",
        id="config-vocab-size-disagrees",
    ),
    pytest.param(
        lambda f: edit_lines(f / "vocab.txt", lambda lines: lines.insert(0, lines.pop(1))),
        ValueError,
        r"vocab\.txt: \[PAD\] must be the first token",
        id="pad-not-first",
    ),
    pytest.param(
        lambda f: edit_lines(f / "vocab.txt", lambda lines: lines.__setitem__(lines.index("[MASK]"), "[MASKED]")),
        ValueError,
        r"vocab\.txt: the vocabulary has no \[MASK\] token",
        id="no-mask-token",
    ),
]


@pytest.fixture
def rannet_copy(tmp_path):
    """A copy of a small official checkpoint folder, to break."""
    folder = tmp_path / "rannet"
    shutil.copytree(FIXTURES / "l1_d32_w4_last", folder)
    return folder


def assert_nothing_written(parent, output):
    assert not output.exists()
    assert not [path.name for path in parent.iterdir() if path.name.startswith(f".{output.name}.")]


@pytest.mark.parametrize("break_folder, error, message", BAD_INPUTS)
def test_bad_input_fails_clearly_and_writes_nothing(rannet_copy, tmp_path, break_folder, error, message):
    break_folder(rannet_copy)
    output = tmp_path / "converted"
    with pytest.raises(error, match=message):
        convert_rannet_checkpoint(rannet_copy, output)
    assert_nothing_written(tmp_path, output)


def test_a_failure_while_writing_leaves_nothing(rannet_copy, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("transformers.PreTrainedTokenizerFast.save_pretrained", fail)
    output = tmp_path / "converted"
    with pytest.raises(OSError, match="disk full"):
        convert_rannet_checkpoint(rannet_copy, output)
    assert_nothing_written(tmp_path, output)


def test_an_existing_folder_is_replaced_only_when_asked(rannet_copy, tmp_path):
    """Refused unasked; with overwrite=True the old model's files go (weights in another format too) and the rest
    (a user's notes) stays."""
    output = tmp_path / "converted"
    output.mkdir()
    (output / "old.txt").write_text("keep me")
    (output / "pytorch_model.bin").write_bytes(b"an older model")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert_rannet_checkpoint(rannet_copy, output)
    assert (output / "old.txt").read_text() == "keep me"

    convert_rannet_checkpoint(rannet_copy, output, overwrite=True)
    assert (output / "old.txt").read_text() == "keep me" and (output / "model.safetensors").is_file()
    assert not (output / "pytorch_model.bin").exists()
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


def folder_digest(folder):
    """{relative path: SHA-256} of every file under `folder`."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize(
    "output_of, relation",
    [
        pytest.param(lambda source: source, "is the RAN checkpoint folder", id="the-source"),
        pytest.param(lambda source: source.parent, "contains the RAN checkpoint folder", id="its-parent"),
        pytest.param(lambda source: source / "converted", "lies inside the RAN checkpoint folder", id="inside-it"),
        pytest.param(lambda source: source / ".." / source.name, "is the RAN checkpoint folder", id="dotted-path"),
    ],
)
def test_an_output_folder_that_overlaps_the_source_is_refused(rannet_copy, output_of, relation, overwrite):
    """`--output_dir` equal to `--rannet_dir` (or its parent) with `--overwrite` deleted the official checkpoint and
    exited 0. Any overlap is refused, with or without `overwrite`, and the source is left as it was."""
    before = folder_digest(rannet_copy.parent)
    with pytest.raises(ValueError, match=f"The output folder .* {relation}"):
        convert_rannet_checkpoint(rannet_copy, output_of(rannet_copy), overwrite=overwrite)
    assert folder_digest(rannet_copy.parent) == before


def test_a_symlink_to_the_source_is_refused_on_the_command_line(rannet_copy, tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT), run_name="convert_rannet_checkpoint")["main"]
    link = tmp_path / "link"
    link.symlink_to(rannet_copy)
    before = folder_digest(rannet_copy)
    with pytest.raises(SystemExit) as exit_info:
        main(["--rannet_dir", str(rannet_copy), "--output_dir", str(link), "--overwrite"])
    assert exit_info.value.code == 1
    assert "is the RAN checkpoint folder" in capsys.readouterr().err
    assert folder_digest(rannet_copy) == before


def finished_process_id() -> int:
    """The id of a process that has ended (what a killed conversion leaves in its folder names)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_what_a_killed_conversion_left_is_cleaned_up(rannet_copy, tmp_path, caplog):
    """Staging folders of killed runs piled up beside the output. The next run deletes a half-written new folder,
    puts back an old folder that was set aside when the kill came between the two renames, and leaves the folders of
    a process that is still running alone, naming them."""
    output = tmp_path / "converted"
    dead = finished_process_id()
    half_written = tmp_path / f".converted.converting-{dead}-abc123"
    half_written.mkdir()
    (half_written / "config.json").write_text("{}")
    set_aside = tmp_path / f".converted.previous-{dead}-def456"
    (set_aside / "converted").mkdir(parents=True)
    (set_aside / "converted" / "old.txt").write_text("the model converted before")
    earlier_version = tmp_path / ".converted.converting-k2j4_x9q"  # the naming of earlier versions: no process id
    earlier_version.mkdir()
    running = tmp_path / f".converted.converting-{os.getppid()}-ghi789"
    running.mkdir()

    with caplog.at_level(logging.WARNING), pytest.raises(FileExistsError, match="overwrite=True"):
        convert_rannet_checkpoint(rannet_copy, output)  # the old folder is back, so it is not replaced unasked
    assert (output / "old.txt").read_text() == "the model converted before"
    assert not half_written.exists() and not set_aside.exists() and not earlier_version.exists()
    assert running.exists() and f"left {running} alone: process {os.getppid()}" in caplog.text
    assert f"put back {output}" in caplog.text

    running.rmdir()
    convert_rannet_checkpoint(rannet_copy, output, overwrite=True)
    assert (output / "model.safetensors").is_file()
    assert (output / "old.txt").read_text() == "the model converted before"  # not a model's file: it stays
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_written_files_get_normal_permissions(rannet_copy, tmp_path, umask):
    """The folder was 0700 and the weights 0600 (a temporary folder's and file's modes); now what the umask gives."""
    previous = os.umask(umask)
    try:
        output = convert_rannet_checkpoint(rannet_copy, tmp_path / "converted")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(output.stat().st_mode) == 0o777 & ~umask
    for path in output.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


# --------------------------------------------------------------------------------------------------------------------
# Remote code, without ran_hf
# --------------------------------------------------------------------------------------------------------------------

# Runs where `ran_hf` cannot be imported (see `remote_code.py`): the converted folder alone must do.
REMOTE_FILL_MASK_SCRIPT = r"""
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

folder, expected_file = sys.argv[1], sys.argv[2]
expected = torch.load(expected_file)
# The tokenizer is built in, but AutoTokenizer reads the config, whose classes are remote code.
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
input_ids = tokenizer(expected["text"], return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = model(input_ids=input_ids).logits[0]
report["text_ids"] = input_ids[0].tolist()
report["logits_difference"] = (logits - expected["mlm_logits"]).abs().max().item()
report["model_class"] = type(model).__module__ + "." + type(model).__name__
fill_mask = pipeline("fill-mask", model=folder, trust_remote_code=True, top_k=5)
report["fill_mask"] = [[prediction["token"], prediction["score"]] for prediction in fill_mask(expected["masked_text"])]
"""


def test_converted_folder_loads_as_remote_code_and_fills_masks_without_ran_hf(converted, tmp_path):
    folder = converted["l1_d32_w4_last"]
    expected = load_expected("l1_d32_w4_last")
    text = str(expected["text"])
    masked_text = text.replace("Rain", "[MASK]")
    # What the pipeline must find: the in-process model's top 5 at the masked position.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForMaskedLM.from_pretrained(folder)
    masked = tokenizer(masked_text, return_tensors="pt")
    position = masked["input_ids"][0].tolist().index(tokenizer.mask_token_id)
    with torch.no_grad():
        probabilities = model(**masked).logits[0, position].softmax(-1)
    top = probabilities.topk(5)
    expected_file = tmp_path / "expected.pt"
    torch.save(
        {
            "text": text,
            "masked_text": masked_text,
            "mlm_logits": torch.from_numpy(expected["mlm_logits"][expected["offsets"][-2] :]),
        },
        expected_file,
    )

    report = run_without_ran_hf(REMOTE_FILL_MASK_SCRIPT, [folder, expected_file], tmp_path)

    assert report["model_class"].startswith("transformers_modules.")
    assert report["model_class"].endswith(".modeling_ran.RANForMaskedLM")
    assert report["text_ids"] == expected["text_ids"].tolist()
    assert report["logits_difference"] <= TOLERANCE
    assert [token for token, _ in report["fill_mask"]] == top.indices.tolist()
    np.testing.assert_allclose([score for _, score in report["fill_mask"]], top.values.numpy(), rtol=0, atol=1e-6)
    assert AutoConfig.from_pretrained(folder).model_type == "ran"


def test_importing_ran_hf_leaves_the_converter_unloaded():
    code = (
        "import sys, ran_hf; loaded = [m for m in ('ran_hf.integrations.convert_rannet', 'ran_hf.files.tf_checkpoint')"
        " if m in sys.modules];"
        "assert not loaded, loaded; assert callable(ran_hf.convert_rannet_checkpoint)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
