"""Runs that went wrong without a word: kept as regression tests, grouped by kind.

- diverged runs: a loss or gradient that turns NaN stops the run before it saves or publishes anything, and NaN
  weights are never resumed from, fine-tuned or saved;
- labels: a trained classifier keeps its own classes and their order;
- silent data problems: what the scripts used to drop, or train on, without saying so;
- unclear errors: input that failed deep inside a library, now named with the flag or the file.

Scripts run in this process through their `main(argv)`, on tiny models and data generated here.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import run_classification
import run_pipeline
import train_tokenizer
from ran_hf import RANConfig, RANForSequenceClassification
from training_utils import TrainingDivergedError

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
    train_tokenizer.main(["--train_files", str(topic_files["train"]), "--vocab_size", "300", "--output_dir", str(folder)])
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
    with pytest.raises(TrainingDivergedError, match=r"NaN or infinite at 3 optimizer steps in a row \(steps 2 to 4"):
        run_classification.main(argv)
    assert not output_dir.exists() or not any(output_dir.iterdir())


def test_how_many_nonfinite_steps_stop_a_run_is_a_flag(tokenizer_dir, topic_files, tmp_path):
    argv = classification_argv(
        tokenizer_dir, topic_files, tmp_path / "run", "--learning_rate", "1e30", "--warmup_steps", "0"
    ) + ["--max_steps", "12", "--max_nonfinite_steps", "1"]
    with pytest.raises(TrainingDivergedError, match=r"at 1 optimizer steps in a row \(steps 2 to 2"):
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
    run_classification.main(classification_argv(tokenizer_dir, topic_files, output_dir, "--max_steps", "2", "--save_steps", "2"))
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
    with pytest.raises(ValueError, match=rf"Cannot resume from .*checkpoint-2: its weight {name} in model.safetensors "
                       "holds NaN or infinite values"):
        run_classification.main(argv)
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2"]


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
