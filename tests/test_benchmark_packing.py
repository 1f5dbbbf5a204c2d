"""benchmark_packing.py: training tokens per second with and without packing, in the one result format."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA_DIR


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmarks" / "benchmark_packing.py"


@pytest.mark.needs_data("ag_news")
def test_benchmark_packing_writes_both_arms_and_the_loss_gap(tmp_path):
    prefix = tmp_path / "packing"
    arguments = ["--data_dir", str(DATA_DIR), "--max_documents", "96", "--documents_per_batch", "8"]
    arguments += ["--warmup", "0", "--rounds", "1", "--steps", "2", "--hidden_size", "16", "--num_heads", "2"]
    arguments += ["--vocab_size", "300", "--output", str(prefix)]
    subprocess.run([sys.executable, str(SCRIPT), *arguments], check=True, capture_output=True, timeout=300)
    record = json.loads(prefix.with_suffix(".json").read_text())
    assert record["results"]["first_batch_causal_loss_gap"] < 1e-5  # packing reads each document alone
    for head in record["results"]["heads"]:
        assert head["packed"]["padding_share"] == 0 and head["padded"]["padding_share"] > 0
        assert head["packed"]["real_tokens"] == head["padded"]["real_tokens"]  # the same documents
        assert head["speedup"] > 0
    assert "packed / padded" in prefix.with_suffix(".md").read_text()
