"""The training scripts under `torchrun` with two CPU processes (gloo): replicas end with identical weights, the
checkpoint holds every rank's state, and parameters that get no gradient in a step do not stop DDP."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import run_pipeline
import train_tokenizer
from checkpoints import missing_from_checkpoint
from ran_trainer import parameter_checksum
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

from ran_hf import RANConfig, RANForSequenceClassification


ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"  # conftest.py puts its folders on sys.path


pytestmark = pytest.mark.slow  # training scripts in several processes

TINY_OVERRIDES = "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4"
STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp-data")
    files = run_pipeline.write_topic_documents(folder, {"train": 24}, seed=2)
    # Documents shorter than one window (16 tokens): the cell-residual weights of every layer get no gradient.
    short = folder / "short.jsonl"
    with short.open("w") as handle:
        for index in range(16):
            handle.write(
                json.dumps({"text": "the planet orbits" if index % 2 else "the recipe simmers", "label": index % 2})
                + "\n"
            )
    train_tokenizer.main(
        ["--train_files", str(files["train"]), "--vocab_size", "300", "--output_dir", str(folder / "tok")]
    )
    return {"long": files["train"], "short": short, "tokenizer": folder / "tok"}


def torchrun(script: str, argv: list[str], **env_overrides) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(SCRIPTS / script), *argv, "--use_cpu", "--ddp_backend", "gloo"]
    command += ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="warning", **env_overrides)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def check_replicas_and_checkpoint(output_dir: Path, auto_class) -> None:
    """Both ranks logged the same parameter checksum, equal to the saved model's; the checkpoint is complete."""
    records = [json.loads((output_dir / "checksums" / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert records[0]["sha256"] == records[1]["sha256"]
    assert records[0]["global_step"] == records[1]["global_step"] == STEPS
    assert records[0]["sha256"] == parameter_checksum(auto_class.from_pretrained(output_dir))

    checkpoint = output_dir / f"checkpoint-{STEPS}"
    assert missing_from_checkpoint(checkpoint) == []
    files = {path.name for path in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "modeling_ran.py"} <= files
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= files  # one RNG state per process
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == STEPS


def test_run_mlm_on_two_processes(data, tmp_path):
    completed = torchrun(
        "language-modeling/run_mlm.py",
        ["--tokenizer_name", str(data["tokenizer"]), "--config_overrides", TINY_OVERRIDES]
        + ["--train_file", str(data["long"]), "--max_seq_length", "48", "--do_train", "--output_dir", str(tmp_path)]
        + ["--max_steps", str(STEPS), "--save_steps", str(STEPS), "--per_device_train_batch_size", "2"]
        + ["--parameter_checksum_dir", str(tmp_path / "checksums")],
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    check_replicas_and_checkpoint(tmp_path, AutoModelForMaskedLM)
    assert json.loads((tmp_path / "all_results.json").read_text())["train_samples"] > 0


def classification_argv(data, output_dir: Path, overrides: str = TINY_OVERRIDES) -> list[str]:
    return (
        ["--tokenizer_name", str(data["tokenizer"]), "--config_overrides", overrides]
        + ["--train_file", str(data["short"]), "--do_train", "--output_dir", str(output_dir)]
        + ["--max_steps", str(STEPS), "--save_steps", str(STEPS), "--per_device_train_batch_size", "2"]
        + ["--activation_checkpointing", "--parameter_checksum_dir", str(output_dir / "checksums")]
    )


def test_run_classification_on_two_processes_with_unused_parameters(data, tmp_path):
    """Sequences shorter than one window under activation checkpointing: Trainer alone would turn
    `find_unused_parameters` off and DDP would fail; the scripts turn it on.

    With the reference scan: the fused scan is one autograd node that takes every weight it reads, the cell
    residual's included, so DDP sees them all used and needs no search."""
    overrides = TINY_OVERRIDES + ",scan_implementation=reference"
    completed = torchrun("text-classification/run_classification.py", classification_argv(data, tmp_path, overrides))
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    check_replicas_and_checkpoint(tmp_path, AutoModelForSequenceClassification)

    # The same run with the setting forced off fails on the cell-residual weights, which these inputs never use.
    failed = torchrun(
        "text-classification/run_classification.py",
        classification_argv(data, tmp_path / "off", overrides) + ["--ddp_find_unused_parameters", "false"],
    )
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0
    reported = re.search(r"Parameter indices which did not receive grad for rank 0: ([\d ]+)", output)
    assert reported, output[-3000:]
    config = RANConfig.from_pretrained(tmp_path)  # the successful run's config: same model
    names = [name for name, _ in RANForSequenceClassification(config).named_parameters()]  # DDP's index order
    unused = {names[int(index)] for index in reported.group(1).split()}
    assert unused == {
        f"model.layers.{layer}.{module}.{tensor}"
        for layer in (0, 1)
        for module in ("cell_scan.cell_glu.proj", "cell_scan.cell_norm")
        for tensor in ("weight", "bias")
    }


def test_a_run_that_diverges_on_one_rank_stops_on_every_rank(data, tmp_path):
    """Only rank 1's loss is NaN, and without gradient clipping no rank computes a gradient norm: rank 1 alone saw
    the run diverge, stopped, and left rank 0 training on into a collective that rank 1 never joined (a hang until
    the run's timeout, unless a launcher killed it). Now every rank stops at the same step with the same error, and
    nothing is saved."""
    argv = classification_argv(data, tmp_path) + ["--max_grad_norm", "0", "--max_steps", "6"]
    completed = torchrun(str(ROOT / "tests" / "diverging_rank_worker.py"), argv)
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0
    stopped = re.findall(
        r"TrainingDivergedError: Training diverged: .* at (3 optimizer steps in a row, steps 1 to 3)", output
    )
    assert len(stopped) == 2, output[-3000:]  # one per rank
    assert not (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("checkpoint-*"))
