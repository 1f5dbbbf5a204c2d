"""Runs that went wrong without a word: kept as regression tests, grouped by kind.

- diverged runs: a loss or gradient that turns NaN stops the run before it saves or publishes anything, and NaN
  weights are never resumed from, fine-tuned or saved;
- labels: a trained classifier keeps its own classes and their order;
- silent data problems: what the scripts used to drop, or train on, without saying so;
- unclear errors: input that failed deep inside a library, now named with the flag or the file.

Scripts run in this process through their `main(argv)`, on tiny models and data generated here.
"""

import json
import random
import re
from pathlib import Path

import evaluate_perplexity
import pytest
import run_classification
import run_clm
import run_ner
import run_pipeline
import run_summarization
import torch
import train_embeddings
import train_tokenizer
from checkpoints import refuse_diverged_checkpoint
from ran_trainer import TrainingDivergedError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from ran_hf import RANConfig, RANForSequenceClassification, RANForTokenClassification
from ran_hf.files.data import read_conll, read_records


# Windows of 16 tokens, so that every test document spans several; no dropout, so that runs are reproducible.
TINY_OVERRIDES = (
    "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4,"
    "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
)
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning"]


@pytest.fixture(scope="module")
def topic_files(tmp_path_factory):
    """Small synthetic long-document classification splits (six topics)."""
    return run_pipeline.write_topic_documents(
        tmp_path_factory.mktemp("topics"), {"train": 24, "validation": 8, "test": 8}, seed=1
    )


@pytest.fixture(scope="module")
def tokenizer_dir(topic_files, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer.main(
        ["--train_files", str(topic_files["train"]), "--vocab_size", "300", "--output_dir", str(folder)]
    )
    return folder


def classification_argv(tokenizer_dir, topic_files, output_dir, *extra) -> list[str]:
    """A tiny from-scratch classifier run on the topic documents."""
    return (
        ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--output_dir", str(output_dir)]
        + ["--train_file", str(topic_files["train"]), "--max_seq_length", "64", "--do_train"]
        + ["--per_device_train_batch_size", "4", *extra]
        + QUIET
    )


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def poison(weights: Path, name_part: str) -> str:
    """Put a NaN into the first tensor of a safetensors file whose name contains `name_part`; returns its name."""
    tensors = load_file(weights)
    name = next(key for key in sorted(tensors) if name_part in key)
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    return name


# ---- diverged runs -------------------------------------------------------------------------------------------------


def test_a_diverging_run_stops_before_saving_anything(tokenizer_dir, topic_files, tmp_path):
    """A learning rate of 1e30 made the gradients NaN from the second step; the run trained on (logging `loss 0`),
    saved and carded the NaN model and exited 0. Now it stops at the third NaN step, before the checkpoint due at
    step 4, and leaves no model, no card and no checkpoint."""
    output_dir = tmp_path / "run"
    argv = classification_argv(
        tokenizer_dir, topic_files, output_dir, "--learning_rate", "1e30", "--warmup_steps", "0"
    ) + ["--max_steps", "12", "--save_steps", "4"]
    with pytest.raises(
        TrainingDivergedError, match=r"NaN or infinite at 3 optimizer steps in a row, steps 2 to 4 \(last loss nan"
    ):
        run_classification.main(argv)
    assert not output_dir.exists() or not any(output_dir.iterdir())


def test_how_many_nonfinite_steps_stop_a_run_is_a_flag(tokenizer_dir, topic_files, tmp_path):
    argv = classification_argv(
        tokenizer_dir, topic_files, tmp_path / "run", "--learning_rate", "1e30", "--warmup_steps", "0"
    ) + ["--max_steps", "12", "--max_nonfinite_steps", "1"]
    with pytest.raises(TrainingDivergedError, match=r"NaN or infinite at optimizer step 2 \(last loss nan"):
        run_classification.main(argv)
    with pytest.raises(ValueError, match="--max_nonfinite_steps must be at least 1, got 0"):
        run_classification.main(argv[:-2] + ["--max_nonfinite_steps", "0"])


def test_a_healthy_run_is_not_stopped(tokenizer_dir, topic_files, tmp_path):
    output_dir = tmp_path / "run"
    run_classification.main(classification_argv(tokenizer_dir, topic_files, output_dir, "--max_steps", "3"))
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "README.md").is_file()


@pytest.fixture(scope="module")
def run_with_a_checkpoint(tokenizer_dir, topic_files, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("checkpointed") / "run"
    run_classification.main(
        classification_argv(tokenizer_dir, topic_files, output_dir, "--max_steps", "2", "--save_steps", "2")
    )
    return output_dir


@pytest.mark.parametrize("resume", ["path", "latest"])
def test_a_checkpoint_with_nan_weights_is_not_resumed(
    run_with_a_checkpoint, tokenizer_dir, topic_files, tmp_path, resume
):
    """A NaN inside an intact-looking checkpoint trained on and was saved and published. Now resuming from it, by
    path or as `latest`, is refused, naming the weight and the file, before any training."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    checkpoint = output_dir / "checkpoint-2"
    checkpoint.mkdir()
    for path in (run_with_a_checkpoint / "checkpoint-2").iterdir():
        (checkpoint / path.name).write_bytes(path.read_bytes())
    name = poison(checkpoint / "model.safetensors", "classifier")
    argv = classification_argv(tokenizer_dir, topic_files, output_dir, "--max_steps", "4")
    argv += ["--resume_from_checkpoint", str(checkpoint) if resume == "path" else "latest"]
    with pytest.raises(
        ValueError,
        match=rf"Cannot resume from .*checkpoint-2: its weight {name} in model.safetensors "
        "holds NaN or infinite values",
    ):
        run_classification.main(argv)
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2"]


@pytest.mark.parametrize("layout", ["sharded", "full", "local"])
def test_nan_weights_in_an_fsdp_checkpoint_are_found(tmp_path, layout):
    """FSDP checkpoints keep their weights in files and folders of their own (`pytorch_model_fsdp_0/`, a
    torch.distributed.checkpoint of shards; `pytorch_model_fsdp.bin`; one `pytorch_model_fsdp_rank*.bin` per
    process), which the resume check did not read: a diverged FSDP run was resumed."""
    import torch.distributed.checkpoint as dcp

    weights = {"layers.0.o_proj.weight": torch.ones(4, 4), "classifier.bias": torch.ones(3)}
    weights["classifier.bias"][1] = float("nan")
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    if layout == "sharded":  # as Trainer saves it: the state dict under "model", flattened to "model.<name>"
        with pytest.warns(UserWarning):  # "torch.distributed is disabled ..., assuming ... a single process"
            dcp.save({"model": weights}, checkpoint_id=checkpoint / "pytorch_model_fsdp_0", no_dist=True)
        broken = "model.classifier.bias in pytorch_model_fsdp_0"
    else:
        name = "pytorch_model_fsdp.bin" if layout == "full" else "pytorch_model_fsdp_rank1.bin"
        torch.save(weights, checkpoint / name)
        broken = f"classifier.bias in {name}"
    with pytest.raises(ValueError, match=rf"its weight {broken} holds NaN"):
        refuse_diverged_checkpoint(checkpoint)


def save_classifier(tokenizer_dir, folder: Path, **fields) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = RANConfig(
        **{"vocab_size": len(tokenizer), "hidden_size": 16, "num_attention_heads": 2, "head_dim": 8, **fields}
    )
    RANForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_model_with_nan_weights_is_not_fine_tuned(tokenizer_dir, topic_files, tmp_path):
    model_dir = save_classifier(tokenizer_dir, tmp_path / "model", num_labels=6)
    name = poison(model_dir / "model.safetensors", "embeddings")
    argv = ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out")]
    argv += ["--train_file", str(topic_files["train"]), "--do_train", "--max_steps", "1", *QUIET]
    with pytest.raises(ValueError, match=rf"--model_name_or_path .*model: its weight {name} holds NaN or infinite"):
        run_classification.main(argv)


def test_the_final_save_refuses_nan_weights(tokenizer_dir, topic_files, tmp_path, monkeypatch):
    """Weights that turn NaN at the last step (too few steps to stop the run) are not saved as the model."""
    output_dir = tmp_path / "run"
    train_step = run_classification.RANTrainer.training_step

    def poisoning_step(self, model, inputs, num_items_in_batch=None):
        loss = train_step(self, model, inputs, num_items_in_batch)
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
        return loss

    monkeypatch.setattr(run_classification.RANTrainer, "training_step", poisoning_step)
    with pytest.raises(TrainingDivergedError, match=r"Refusing to save the model to .*run: its weight \S+ holds NaN"):
        run_classification.main(
            classification_argv(tokenizer_dir, topic_files, output_dir, "--max_steps", "1", "--save_strategy", "no")
        )
    assert not (output_dir / "model.safetensors").exists() and not (output_dir / "README.md").exists()
    with pytest.raises(TrainingDivergedError, match=r"Refusing to save the model to .*run/checkpoint-1: its weight"):
        run_classification.main(classification_argv(tokenizer_dir, topic_files, output_dir, "--max_steps", "1"))
    assert not (output_dir / "checkpoint-1").exists()


def embedding_argv(tokenizer_dir, topic_files, output_dir, *extra) -> list[str]:
    """A tiny from-scratch `train_embeddings.py` run: one pooling, no baseline, held-out topics as queries and
    corpus."""
    return [
        "--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES + ",num_hidden_layers=1",
        "--train_file", str(topic_files["train"]), "--test_file", str(topic_files["train"]), "--num_train_pairs", "32",
        "--num_queries", "4", "--num_corpus", "12", "--poolings", "mean", "--no_baseline", "--max_seq_length", "64",
        "--per_device_train_batch_size", "4", "--output_dir", str(output_dir), "--report_to", "none",
        "--disable_tqdm", "true", *extra,
    ]  # fmt: skip


def test_a_diverging_embedding_run_stops_before_saving_anything(tokenizer_dir, topic_files, tmp_path):
    """sentence-transformers' trainer has no such stop: at this learning rate it trained on NaN and saved a model of
    NaN weights, exit 0."""
    argv = embedding_argv(tokenizer_dir, topic_files, tmp_path / "out", "--learning_rate", "1e9")
    with pytest.raises(TrainingDivergedError, match=r"NaN or infinite at 3 optimizer steps in a row"):
        train_embeddings.main(argv + ["--max_grad_norm", "0"])
    assert not list((tmp_path / "out").glob("ran-mean/*"))  # Trainer made the folder; nothing was saved in it


def test_an_embedding_model_with_nan_weights_is_not_trained(tokenizer_dir, topic_files, tmp_path):
    """It trained with a loss of 0 and saved the model, exit 0."""
    model_dir = save_classifier(tokenizer_dir, tmp_path / "model", num_labels=6)
    name = poison(model_dir / "model.safetensors", "embeddings")
    argv = embedding_argv(tokenizer_dir, topic_files, tmp_path / "out")
    at = argv.index("--config_overrides")
    argv[at : at + 2] = ["--model_name_or_path", str(model_dir)]
    with pytest.raises(ValueError, match=rf"model: its weight 0.model.{name.removeprefix('model.')} holds NaN"):
        train_embeddings.main(argv)
    assert not list((tmp_path / "out").glob("ran-mean/*"))  # Trainer made the folder; nothing was saved in it


# ---- labels: a trained model's classes are its own ------------------------------------------------------------------

TOPICS = ("astronomy", "cooking", "finance", "football", "medicine", "sailing")


def predictions_of(model_dir: Path, documents: Path, max_length: int) -> list[str]:
    """The class names a saved classifier predicts for the documents, read through its own id2label."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    names = []
    for line in documents.read_text(encoding="utf-8").splitlines():
        encoded = tokenizer(json.loads(line)["text"], truncation=True, max_length=max_length, return_tensors="pt")
        with torch.no_grad():
            names.append(model.config.id2label[int(model(**encoded).logits.argmax(-1))])
    return names


def test_a_trained_classifier_keeps_the_order_of_its_classes(tokenizer_dir, topic_files, tmp_path):
    """`run_classification.py` re-ordered an existing model's id2label alphabetically, so every prediction and
    metric came out under another class's name. Now the model's order is kept, for evaluation and for training."""
    own_order = tuple(reversed(TOPICS))
    model_dir = save_classifier(
        tokenizer_dir,
        tmp_path / "model",
        id2label=dict(enumerate(own_order)),
        label2id={n: i for i, n in enumerate(own_order)},
    )
    output_dir = tmp_path / "evaluated"
    results = run_classification.main(
        ["--model_name_or_path", str(model_dir), "--output_dir", str(output_dir), "--max_seq_length", "64"]
        + ["--test_file", str(topic_files["test"]), "--do_predict", *QUIET]
    )
    assert results["labels"] == list(own_order)
    predicted = [line.split("\t")[1] for line in (output_dir / "predict_results.txt").read_text().splitlines()[1:]]
    assert predicted == predictions_of(model_dir, topic_files["test"], max_length=64)

    trained_dir = tmp_path / "trained"
    run_classification.main(
        ["--model_name_or_path", str(model_dir), "--output_dir", str(trained_dir), "--max_seq_length", "64"]
        + ["--train_file", str(topic_files["train"]), "--do_train", "--max_steps", "1", *QUIET]
    )
    assert json.loads((trained_dir / "config.json").read_text())["id2label"] == {
        str(index): name for index, name in enumerate(own_order)
    }


def test_evaluating_on_data_without_some_of_the_classes(tokenizer_dir, topic_files, tmp_path):
    """Evaluating a six-class model on documents of two classes crashed (two classes inferred from the data, a head
    of six); now the data's labels are mapped onto the model's six."""
    model_dir = save_classifier(tokenizer_dir, tmp_path / "model", id2label=dict(enumerate(TOPICS)))
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    with torch.no_grad():  # a model that answers "sailing" (id 5) for every document
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.arange(6.0) == TOPICS.index("sailing"))
    model.save_pretrained(model_dir)
    records = [json.loads(line) for line in topic_files["validation"].read_text().splitlines()]
    two_topics = write_jsonl(tmp_path / "two.jsonl", [r for r in records if r["label"] in ("cooking", "sailing")])
    results = run_classification.main(
        ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out"), "--max_seq_length", "64"]
        + ["--validation_file", str(two_topics), "--do_eval", *QUIET]
    )
    assert results["labels"] == list(TOPICS)
    # Scored under the model's ids, "sailing" is right for the sailing documents; under the data's own two ids
    # (cooking 0, sailing 1) the model's 5 would match none.
    truth = [json.loads(line)["label"] for line in two_topics.read_text().splitlines()]
    assert set(predictions_of(model_dir, two_topics, max_length=64)) == {"sailing"}
    assert 0 < truth.count("sailing") < len(truth)
    assert results["eval"]["eval_accuracy"] == pytest.approx(truth.count("sailing") / len(truth))


def test_labels_a_trained_classifier_lacks_are_named(tokenizer_dir, topic_files, tmp_path):
    model_dir = save_classifier(tokenizer_dir, tmp_path / "model", id2label=dict(enumerate(TOPICS[:5])))
    argv = ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out")]
    argv += ["--validation_file", str(topic_files["validation"]), "--do_eval", *QUIET]
    with pytest.raises(ValueError, match=r"labels that the model .*model does not have: \['sailing'\]"):
        run_classification.main(argv)
    # a new head for six classes may replace the five-class one, in the data's order
    results = run_classification.main(argv + ["--ignore_mismatched_sizes"])
    assert results["labels"] == list(TOPICS)


def test_a_model_without_named_classes_gets_the_data_s_in_sorted_order(tokenizer_dir, topic_files, tmp_path):
    model_dir = save_classifier(tokenizer_dir, tmp_path / "model", num_labels=6)  # LABEL_0 ... LABEL_5
    results = run_classification.main(
        ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out"), "--max_seq_length", "64"]
        + ["--train_file", str(topic_files["train"]), "--do_train", "--max_steps", "1", *QUIET]
    )
    assert results["labels"] == list(TOPICS)


CONLL_SENTENCES = [
    ("EU rejects German call to boycott British lamb .", "B-ORG O B-MISC O O O B-MISC O O"),
    ("Peter Blackburn", "B-PER I-PER"),
    ("BRUSSELS 1996-08-22", "B-LOC O"),
    ("The European Commission said on Thursday", "O B-ORG I-ORG O O O"),
]


def write_conll(path: Path, sentences) -> Path:
    lines = []
    for words, tags in sentences:
        lines += [f"{word} NN B-NP {tag}" for word, tag in zip(words.split(), tags.split())] + [""]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def conll_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("conll")
    train = write_conll(folder / "train.txt", CONLL_SENTENCES * 4)
    tokenizer_dir = folder / "tokenizer"
    train_tokenizer.main(
        ["--train_files", str(train), "--conll", "--vocab_size", "120", "--output_dir", str(tokenizer_dir)]
    )
    return {
        "train": train,
        "people": write_conll(folder / "people.txt", CONLL_SENTENCES[1:2] * 2),
        "tokenizer": tokenizer_dir,
    }


def save_tagger(tokenizer_dir: Path, folder: Path, tags) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = RANConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_attention_heads=2,
        head_dim=8,
        id2label=dict(enumerate(tags)),
        label2id={tag: index for index, tag in enumerate(tags)},
    )
    RANForTokenClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_trained_tagger_keeps_the_order_of_its_tags(conll_files, tmp_path):
    own_order = ("I-PER", "B-PER", "I-ORG", "B-ORG", "B-MISC", "B-LOC", "O")
    model_dir = save_tagger(conll_files["tokenizer"], tmp_path / "model", own_order)
    argv = ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out"), *QUIET]
    results = run_ner.main(argv + ["--validation_file", str(conll_files["people"]), "--do_eval"])
    assert results["labels"] == list(own_order)  # and data with only two of the tags is evaluated

    model_dir = save_tagger(conll_files["tokenizer"], tmp_path / "small", own_order[:-2])
    first = rf"The first, 'O', is in {re.escape(str(conll_files['train']))}:1 \(validation sentence 1\)"
    with pytest.raises(ValueError, match=rf"tags that the model .*small does not have: \['B-LOC', 'O'\] .*{first}"):
        run_ner.main(
            ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out2"), *QUIET]
            + ["--validation_file", str(conll_files["train"]), "--do_eval"]
        )


# ---- silent data problems ------------------------------------------------------------------------------------------


def test_entities_cut_off_by_max_seq_length_are_counted(conll_files, tmp_path, caplog):
    """`--max_seq_length` dropped the words past the cut, entities included, from training and from the scores
    without a word. Now a warning counts them."""
    argv = ["--tokenizer_name", str(conll_files["tokenizer"]), "--config_overrides", TINY_OVERRIDES]
    argv += ["--output_dir", str(tmp_path / "out"), "--train_file", str(conll_files["train"]), "--do_train"]
    argv += ["--max_steps", "1", "--max_seq_length", "4", "--report_to", "none", "--disable_tqdm", "true"]
    with caplog.at_level("WARNING"):
        run_ner.main(argv)
    tokenizer = AutoTokenizer.from_pretrained(conll_files["tokenizer"])
    cut_words = cut_entity_words = cut_sentences = 0
    for words, tags in CONLL_SENTENCES * 4:
        kept = 1 + max(
            w
            for w in tokenizer(words.split(), is_split_into_words=True, truncation=True, max_length=4).word_ids()
            if w is not None
        )
        cut_sentences += kept < len(words.split())
        cut_words += len(words.split()) - kept
        cut_entity_words += sum(tag != "O" for tag in tags.split()[kept:])
    assert cut_entity_words > 0
    assert (
        f"train: --max_seq_length 4 cut {cut_sentences} of 16 sentences short: {cut_words} words, "
        f"{cut_entity_words} of them tagged as entities (not 'O'), are neither trained on nor scored"
    ) in caplog.text


def test_perplexity_of_a_model_that_is_not_a_causal_lm_is_refused(tokenizer_dir, topic_files, tmp_path):
    """A classifier or MLM folder loaded as a causal LM got an output layer it was never trained with, and its
    "perplexity" was reported as if it were one."""
    model_dir = save_classifier(tokenizer_dir, tmp_path / "model", is_causal=True)
    text = tmp_path / "text.txt"
    text.write_text("the first line of text\nand a second one\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"model is a RANForSequenceClassification, not a causal language model"):
        evaluate_perplexity.main(["--model_name_or_path", str(model_dir), "--text_file", str(text)])


def test_a_null_text_does_not_train_the_tokenizer_as_the_word_none(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "some words here"}, {"text": None}])
    with pytest.raises(ValueError, match=r"corpus.jsonl, line 2: column 'text' holds null"):
        train_tokenizer.main(
            ["--train_files", str(corpus), "--vocab_size", "100", "--output_dir", str(tmp_path / "t")]
        )


def test_documents_without_text_or_label_are_skipped_and_counted_for_embeddings(tmp_path, caplog):
    records = [
        {"text": "a post about sailing boats", "label": "sailing"},
        {"text": None, "label": "sailing"},
        {"text": "   ", "label": "cooking"},
        {"text": "a post about stew", "label": None},
        {"text": "another post about sailing", "label": "sailing"},
    ]
    path = write_jsonl(tmp_path / "posts.jsonl", records)
    data_args = train_embeddings.DataTrainingArguments(train_file=str(path), test_file=str(path))
    with caplog.at_level("WARNING"):
        documents = train_embeddings.read_documents(str(path), data_args)
    assert [text for text, _ in documents] == ["a post about sailing boats", "another post about sailing"]
    assert (
        "skipped 2 documents without text (null or blank after --strip_headers) and 1 without a label" in caplog.text
    )


def test_pairs_cannot_be_drawn_when_every_label_is_unique():
    """`train_embeddings.py` looped forever looking for two documents of one label."""
    documents = [(f"document {index}", frozenset([str(index)])) for index in range(5)]
    with pytest.raises(ValueError, match="No two of the 5 training documents share a label"):
        train_embeddings.training_pairs(documents, 10, random.Random(0))


def test_stream_training_with_fewer_chunks_than_streams(tokenizer_dir, topic_files, tmp_path):
    """Keeping fewer chunks than streams made no whole batch: 0 training steps and an untrained model saved."""
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--output_dir"]
    argv += [str(tmp_path / "clm"), "--train_file", str(topic_files["train"]), "--do_train", "--stream_training"]
    argv += ["--block_size", "32", "--per_device_train_batch_size", "4", "--max_train_samples", "3", *QUIET]
    with pytest.raises(ValueError, match=r"--max_train_samples 3 keeps fewer chunks than the 4 streams"):
        run_clm.main(argv)
    assert not (tmp_path / "clm" / "model.safetensors").exists()


def test_resuming_with_other_config_overrides_names_the_changed_fields(
    run_with_a_checkpoint, tokenizer_dir, topic_files, tmp_path
):
    """A run resumed after `--config_overrides` changed the architecture (same weight shapes) trained on without a
    word: another model continued the checkpoint's weights."""
    output_dir = tmp_path / "run"
    (output_dir / "checkpoint-2").mkdir(parents=True)
    for path in (run_with_a_checkpoint / "checkpoint-2").iterdir():
        (output_dir / "checkpoint-2" / path.name).write_bytes(path.read_bytes())
    argv = classification_argv(tokenizer_dir, topic_files, output_dir, "--max_steps", "4")
    argv[argv.index(TINY_OVERRIDES)] = TINY_OVERRIDES.replace("window_size=16", "window_size=8")
    with pytest.raises(
        ValueError,
        match=r"checkpoint-2: its model was built with other settings than this run's "
        r"\(window_size: 16 there, 8 now\)",
    ):
        run_classification.main(argv + ["--resume_from_checkpoint", "latest"])


# ---- unclear errors ------------------------------------------------------------------------------------------------


def test_a_json_array_instead_of_json_lines(tokenizer_dir, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps([{"text": "a", "label": "x"}, {"text": "b", "label": "y"}], indent=2))
    with pytest.raises(
        ValueError,
        match=r"train.jsonl, line 1: expected a JSON object, got the start of a JSON array. This reader takes "
        "JSON Lines",
    ):
        read_records(path)


def test_one_lora_target_module(tokenizer_dir, topic_files, tmp_path):
    """One `--lora_target_modules` name was passed to PEFT as a str, which PEFT reads as a regular expression that
    must match a whole module path: "Target modules o_proj not found". Now one name adapts the modules it names."""
    pytest.importorskip("peft")
    model_dir = save_classifier(tokenizer_dir, tmp_path / "model", id2label=dict(enumerate(TOPICS)))
    output_dir = tmp_path / "adapter"
    run_classification.main(
        ["--model_name_or_path", str(model_dir), "--output_dir", str(output_dir), "--max_seq_length", "64"]
        + ["--train_file", str(topic_files["train"]), "--do_train", "--max_steps", "1"]
        + ["--lora_r", "2", "--lora_target_modules", "o_proj", *QUIET]
    )
    assert json.loads((output_dir / "adapter_config.json").read_text())["target_modules"] == ["o_proj"]


def test_integer_ner_tags_in_jsonl(tokenizer_dir, tmp_path):
    """Named by the sentence's number only; now by the file's line too (a blank line makes them differ)."""
    path = tmp_path / "train.jsonl"
    path.write_text("\n" + json.dumps({"tokens": ["EU", "rejects"], "ner_tags": [3, 0]}) + "\n", encoding="utf-8")
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--output_dir"]
    argv += [str(tmp_path / "out"), "--train_file", str(path), "--do_train", "--max_steps", "1", *QUIET]
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(path))}:2 \(train sentence 1\): column 'ner_tags' holds tag ids \(\[3, 0\]\); a "
        "jsonl file must give tag names",
    ):
        run_ner.main(argv)


def test_a_bad_conll_tag_is_named_by_file_and_line(conll_files, tmp_path):
    """A tag the training split never uses (a typo) was named with its split only: finding it in a CoNLL file of
    thousands of sentences was left to the user. Now the error names the file and the line of the sentence."""
    validation = write_conll(tmp_path / "valid.txt", CONLL_SENTENCES[:2] + [("Paris is", "B-LCO O")])
    argv = ["--tokenizer_name", str(conll_files["tokenizer"]), "--config_overrides", TINY_OVERRIDES]
    argv += ["--output_dir", str(tmp_path / "out"), "--train_file", str(conll_files["train"]), "--do_train"]
    argv += ["--validation_file", str(validation), "--do_eval", "--max_steps", "1", *QUIET]
    # 9 token lines and a blank one, 2 and a blank one: the third sentence starts on line 14
    unseen = r"The validation split has tags the train split never uses: \['B-LCO'\]\."
    where = rf"The first, 'B-LCO', is in {re.escape(str(validation))}:14 \(validation sentence 3\)\."
    with pytest.raises(ValueError, match=rf"{unseen} {where}"):
        run_ner.main(argv)
    assert [sentence["line"] for sentence in read_conll(validation, with_lines=True)] == [1, 11, 14]
    assert "line" not in read_conll(validation)[0]  # the data's columns, unless asked


def test_a_bad_sentence_is_named_by_file_and_line(tmp_path):
    """`check_sentences` names a sentence of a file by its line (a CoNLL sentence's first token, a jsonl record's
    line, looked up only for the error), then its number."""
    batch = {"tokens": [["EU"], ["Paris"]], "ner_tags": [["B-ORG"], [" "]]}
    source = run_ner.SentenceFile("valid.txt", lines=(1, 4))
    with pytest.raises(ValueError, match=r"^valid.txt:4 \(test sentence 2\): column 'tag' holds only whitespace"):
        run_ner.check_sentences(batch, [0, 1], "test", "word", "tag", source)
    records = [json.dumps({"tokens": words, "ner_tags": tags}) for words, tags in zip(*batch.values())]
    (tmp_path / "test.jsonl").write_text(f"{records[0]}\n\n  \n{records[1]}\n")
    source = run_ner.SentenceFile(str(tmp_path / "test.jsonl"))
    with pytest.raises(ValueError, match=r"test.jsonl:4 \(test sentence 2\): column 'tag' holds only whitespace"):
        run_ner.check_sentences(batch, [0, 1], "test", "word", "tag", source)
    with pytest.raises(ValueError, match=r"^test sentence 2: column 'tag' holds only whitespace"):  # Hub data
        run_ner.check_sentences(batch, [0, 1], "test", "word", "tag")


def test_a_lone_surrogate_in_jsonl_is_named(tmp_path):
    """`"\\ud800"` is valid JSON but no text: the tokenizer failed on it with "TypeError: TextEncodeInput must be
    ..."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine", "label": "a"}\n{"text": "broken \\ud800 here", "label": "b"}\n')
    with pytest.raises(
        ValueError,
        match=r"train.jsonl, line 2: column 'text' holds a lone surrogate '\\ud800' at "
        "character 8",
    ):
        read_records(path, ["text"])


@pytest.mark.parametrize(
    "record, column",
    [
        pytest.param({"text": "broken \ud800 here", "label": "a"}, "text", id="tokenizer-text"),
        pytest.param({"text": "a fine text", "label": "\ud800"}, "label", id="label"),
    ],
)
def test_a_lone_surrogate_is_named_by_the_scripts_that_read_whole_files(tmp_path, record, column):
    """`train_tokenizer.py` (and `train_embeddings.py`) did not name it: Arrow could not store the string, and the
    fall-back reader built a dataset of it, which failed with "UnicodeEncodeError: 'utf-8' codec can't encode ..."."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "fine words", "label": "b"}, record])
    message = rf"train.jsonl, line 2: column '{column}' holds a lone surrogate"
    with pytest.raises(ValueError, match=message):
        train_tokenizer.main(["--train_files", str(path), "--vocab_size", "100", "--output_dir", str(tmp_path / "t")])
    data_args = train_embeddings.DataTrainingArguments(train_file=str(path), test_file=str(path))
    with pytest.raises(ValueError, match=message):
        train_embeddings.read_documents(str(path), data_args)


def test_stream_training_with_gradient_checkpointing(tokenizer_dir, topic_files, tmp_path):
    """It failed at the first step with "AttributeError: 'NoneType' object has no attribute 'detach'"."""
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--output_dir"]
    argv += [str(tmp_path / "clm"), "--train_file", str(topic_files["train"]), "--do_train", "--stream_training"]
    argv += ["--block_size", "32", "--gradient_checkpointing", "--max_steps", "1", *QUIET]
    with pytest.raises(ValueError, match=r"--stream_training carries .* drop --gradient_checkpointing"):
        run_clm.main(argv)


@pytest.mark.parametrize(
    "num_queries, num_corpus, message",
    [
        pytest.param(6, 10, "after --num_queries 6 queries none is left for the corpus", id="no-corpus"),
        pytest.param(2, 1, "no query shares a label with one of the 1 corpus documents", id="nothing-relevant"),
    ],
)
def test_retrieval_without_a_corpus_or_a_relevant_document(num_queries, num_corpus, message):
    """Both ended in a ZeroDivisionError after the evaluator dropped every query without a relevant document."""
    documents = [(f"document {index}", frozenset([str(index)])) for index in range(6)]
    data_args = train_embeddings.DataTrainingArguments(
        train_file="unused", test_file="unused", num_queries=num_queries, num_corpus=num_corpus
    )
    with pytest.raises(ValueError, match=rf"--test_file holds 6 documents .*{message}"):
        train_embeddings.retrieval_evaluator(documents, data_args, random.Random(0), batch_size=2)


@pytest.mark.parametrize(
    "lines, message",
    [
        pytest.param(
            [json.dumps([{"text": "a title\nits body"}])],
            r"line 1: expected a JSON object, got the start of a JSON array",
            id="json-array",  # was "AttributeError: 'list' object has no attribute 'get'"
        ),
        pytest.param(
            ['{"text": "a title\\nits body"}', '{"text": '],
            r"line 2: not valid JSON",
            id="broken-line",  # was json's "Expecting value: line 2 column 1 (char 10)", naming no file
        ),
        pytest.param(
            ['{"text": "a title\\nbody \\ud800 here"}'],
            r"line 1: column 'text' holds a lone surrogate",
            id="lone-surrogate",  # was the tokenizer's "TypeError: TextEncodeInput must be Union[...]"
        ),
        pytest.param(["7"], r"line 1: expected a JSON object, got int", id="not-an-object"),
    ],
)
def test_summarization_data_that_is_not_json_lines_of_texts(tokenizer_dir, tmp_path, lines, message):
    """`run_summarization.py` read its files with its own loop, and these failed deep inside json, a dict lookup or
    the tokenizer; it now reads them as every other script does, naming the file and line."""
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--output_dir"]
    argv += [str(tmp_path / "out"), "--train_file", str(path), "--title_from_first_line", "--do_train", *QUIET]
    with pytest.raises(ValueError, match=rf"train.jsonl, {message}"):
        run_summarization.main(argv)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_summarization_records_without_a_body_are_counted(tmp_path, caplog):
    records = [{"text": "a title\nits body"}, {"text": "a title alone"}, {"text": "another title\nanother body"}]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    data_args = run_summarization.DataTrainingArguments(train_file=str(path), title_from_first_line=True)
    with caplog.at_level("WARNING"):
        pairs = run_summarization.read_pairs(str(path), data_args, limit=None)
    assert pairs == [("its body", "a title"), ("another body", "another title")]
    assert "skipped 1 records whose source or target is blank; 2 kept" in caplog.text


@pytest.mark.parametrize(
    "script, flags, message",
    [
        pytest.param(
            run_classification,
            ["--max_train_samples", "0"],
            r"--max_train_samples must be at least 1 .*got 0",
            id="classification-max_train_samples",  # was "No labels found in column 'label'"
        ),
        pytest.param(
            run_classification,
            ["--max_eval_samples", "0"],
            r"--max_eval_samples must be at least 1 .*got 0",
            id="classification-max_eval_samples",  # was "Column 'input_ids' doesn't exist"
        ),
        pytest.param(
            run_clm,
            ["--max_train_samples", "0", "--block_size", "32"],
            r"--max_train_samples must be at least 1 .*got 0",
            id="clm-max_train_samples",  # was "num_samples should be a positive integer value"
        ),
        pytest.param(
            run_clm,
            ["--validation_split_percentage", "100", "--block_size", "32"],
            r"--validation_split_percentage must be in \[0, 100\) .*got 100",
            id="clm-validation_split_percentage",  # was "test_size=1.0 should be either positive ..."
        ),
    ],
)
def test_flags_that_keep_no_data(script, flags, message, tokenizer_dir, topic_files, tmp_path):
    """Each failed deep in `datasets` or the sampler with a message that named no flag (beside each case)."""
    argv = ["--tokenizer_name", str(tokenizer_dir), "--config_overrides", TINY_OVERRIDES, "--output_dir"]
    argv += [str(tmp_path / "out"), "--train_file", str(topic_files["train"]), "--do_train", "--max_steps", "1"]
    argv += ["--validation_file", str(topic_files["validation"]), "--do_eval"] if "max_eval" in flags[0] else []
    with pytest.raises(ValueError, match=message):
        script.main(argv + flags + QUIET)


@pytest.mark.parametrize("max_tokens", ["0", "1"])
def test_perplexity_of_fewer_than_two_tokens(tmp_path, max_tokens):
    """`--max_tokens 0` or `1` scored no token and failed with a ZeroDivisionError."""
    text = tmp_path / "text.txt"
    text.write_text("some text\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"--max_tokens must be at least 2 .*got {max_tokens}"):
        evaluate_perplexity.main(
            ["--model_name_or_path", "unused", "--text_file", str(text), "--max_tokens", max_tokens]
        )
