"""Where the benchmark scripts write their results (`benchmark_utils.result_path`, `write_result`): an `--output`
prefix with dots keeps them, and a result file is replaced whole or not at all. What a result holds is checked in
test_result_files.py."""

import json
import sys
from pathlib import Path

import pytest
from benchmark_utils import check_result, result_path, write_result


def test_a_prefix_with_dots_keeps_them_so_two_runs_write_two_files():
    """`recall_lr0.006` and `recall_lr0.0006` once both became `recall_lr0.json` and the second run overwrote the
    first."""
    assert result_path("out/recall_lr0.006", ".json") == Path("out/recall_lr0.006.json")
    assert result_path("out/recall_lr0.006", ".json") != result_path("out/recall_lr0.0006", ".json")
    assert result_path(Path("out/recall"), ".png") == Path("out/recall.png")


@pytest.mark.parametrize("suffix", [".json", ".md", ".png"])
def test_a_prefix_given_with_a_result_suffix_drops_it(suffix):
    assert result_path(f"out/recall{suffix}", ".md") == Path("out/recall.md")


def test_a_failed_write_leaves_the_earlier_result_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "recall.json"
    write_result(path, '{"accuracy": 0.9}')
    assert path.read_text() == '{"accuracy": 0.9}'

    def interrupted(self, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_result(path, '{"accuracy": 0.1}')
    assert path.read_text() == '{"accuracy": 0.9}'


def test_benchmark_commands_times_a_command_against_a_baseline_and_records_where(tmp_path):
    import benchmark_commands

    output = tmp_path / "commands" / "pair"
    python = sys.executable
    result = benchmark_commands.main(
        ["--output", str(output), "--repeats", "2", "--warmup", "0", "--env", "RAN_HF_PROBE=1"]
        + ["--command", f'{python} -c \'import os; assert os.environ["RAN_HF_PROBE"] == "1"\'']
        + ["--baseline", f"{python} -c pass"]
    )
    saved = json.loads((tmp_path / "commands" / "pair.json").read_text())
    assert saved == json.loads(json.dumps(result))
    check_result(saved)
    assert saved["command"].startswith("python scripts/benchmarks/benchmark_commands.py --output")
    assert saved["settings"]["env"] == ["RAN_HF_PROBE=1"] and saved["machine_info"]["cores"] >= 1
    figures = saved["results"]
    assert [len(spread["runs"]) for spread in figures["wall_seconds"].values()] == [2, 2]
    assert figures["ratio_to_baseline"]["cpu_seconds"]["median"] > 0
    assert "ratio, pair by pair" in (tmp_path / "commands" / "pair.md").read_text()


def test_benchmark_commands_stops_on_a_failing_command(tmp_path):
    import benchmark_commands

    with pytest.raises(SystemExit, match="exited 3"):
        benchmark_commands.main(["--output", str(tmp_path / "x"), "--command", f"{sys.executable} -c 'exit(3)'"])
