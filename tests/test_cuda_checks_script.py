"""The GPU run's script (`scripts/benchmarks/run_cuda_checks.sh`, docs/gpu.md) in its smoke mode: every part on the
CPU at tiny sizes, through the same imports, arguments and code paths as on the GPU, so that a GPU session spends its
minutes measuring. Every part exits 0, every result JSON is in the one result format and says device cpu, and
nothing is written outside the given folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_utils import check_result


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmarks" / "run_cuda_checks.sh"
PARTS = ["tests_scan", "tests_tokens", "step_8k", "bf16", "step_32k", "decode", "decode_review", "bf16_check",
         "results_check", "report"]  # fmt: skip


def benchmark_files() -> dict:
    return {path: path.stat().st_mtime_ns for path in (ROOT / "benchmarks").rglob("*") if path.is_file()}


@pytest.mark.slow
def test_the_smoke_run_runs_every_part_on_the_cpu(tmp_path):
    before = benchmark_files()
    out = tmp_path / "out"
    environment = {**os.environ, "PYTHON": sys.executable}
    completed = subprocess.run(["bash", str(SCRIPT), "--smoke", str(out)], cwd=tmp_path, env=environment,
                               capture_output=True, text=True, timeout=900)  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    status = [line.split() for line in (out / "status.txt").read_text().splitlines()]
    logs = {path.name: path.read_text()[-3000:] for path in out.glob("*.log")}
    failed = {line[0]: logs.get(f"{line[0]}.log") for line in status if line[2] != "0"}
    assert not failed, f"parts that did not exit 0: {failed}"
    assert [line[0] for line in status] == PARTS  # no GPU query in the smoke run

    records = {path.name: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert set(records) == {"tests_scan.json", "tests_tokens.json", "profile_1x128.json", "profile_1x256.json",
                            "bf16_cpu.json", "bf16_check.json", "decode_cpu.json",
                            "decode_cpu_review8.json"}  # fmt: skip
    for name, record in records.items():
        check_result(record)
        assert record["device"] == "cpu" and "gpu" not in record["machine_info"], name
    for name in ("tests_scan.json", "tests_tokens.json"):
        results = records[name]["results"]
        assert results["passed"] > 0 and results["failed"] == 0, results
    profile = records["profile_1x128.json"]["results"]
    assert [row["model"] for row in profile] == ["ran-triton", "transformer", "modernbert", "longformer",
                                                 "ran-fused", "ran-triton+pytorch-token-ops"]  # fmt: skip
    for row in profile:
        assert 0 < len(row["top_kernels"]) <= 15 and row["step_seconds"] > 0 and row["peak_bytes"] is None
    assert {row["attention"] for row in profile if row["model"] == "modernbert"} == {"sdpa"}
    assert records["bf16_check.json"]["results"]["rows"]
    decode = records["decode_cpu.json"]
    assert decode["dtype"] == "bfloat16 autocast"
    assert [row["context"] for row in decode["results"]] == [128, 512]
    assert all(row["ran"]["cache_bytes"] > 0 and row["ran"]["ms_per_token"] > 0 for row in decode["results"])
    # Reviewing the last 8 windows only, the cache at 512 tokens (16 windows of 32) keeps fewer cells; no GPT-2.
    bounded = records["decode_cpu_review8.json"]
    assert bounded["settings"]["memory_review_cells"] == 8
    assert bounded["results"][-1]["ran"]["cache_bytes"] < decode["results"][-1]["ran"]["cache_bytes"]
    assert all(row.get("gpt2") is None for row in bounded["results"])
    for name in ("tests_scan.log", "step_8k.log", "decode.log"):
        assert "# device: cpu (smoke run" in logs[name] or "device: cpu" in (out / name).read_text(), name
    # Files of the run's names new or rewritten under benchmarks/ (other work may write there meanwhile).
    written = {path for path, mtime in benchmark_files().items() if before.get(path) != mtime}
    assert not {path for path in written if (out / path.name).exists()}, "the smoke run wrote under benchmarks/"


def test_a_run_whose_parts_fail_exits_nonzero_naming_them(tmp_path):
    """Every part failing (here: an interpreter that cannot run them) exited 0, as if the run had measured."""
    out = tmp_path / "out"
    environment = {**os.environ, "PYTHON": "false"}
    completed = subprocess.run(["bash", str(SCRIPT), "--smoke", str(out)], cwd=tmp_path, env=environment,
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 1
    assert "parts that failed" in completed.stderr and "tests_scan" in completed.stderr
