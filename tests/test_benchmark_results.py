"""Where the benchmark scripts write their results (`benchmark_utils.result_path`, `write_result`): an `--output`
prefix with dots keeps them, and a result file is replaced whole or not at all."""

from pathlib import Path

import pytest
from benchmark_utils import result_path, write_result


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
