"""Every result file under benchmarks/ is in the one result format (`benchmark_utils.RESULT_FIELDS`): the exact
command, the commit, the date, the machine, the device and dtype, the run's settings and its figures. A field may be
null only where the file's `provenance_note` says why."""

import json
from pathlib import Path

import pytest
from benchmark_utils import check_result, command_line, result_record


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULT_FILES = sorted(BENCHMARKS.rglob("*.json"))


def test_there_are_result_files():
    assert len(RESULT_FILES) > 50


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda path: str(path.relative_to(BENCHMARKS)))
def test_result_file_is_in_the_one_format(path):
    record = json.loads(path.read_text())
    try:
        check_result(record)
    except ValueError as error:
        pytest.fail(f"{path.relative_to(BENCHMARKS.parent)}: {error}")


def good_record() -> dict:
    return {
        "command": "python scripts/benchmarks/benchmark_scan.py --repeats 3",
        "commit": "4b3ba45",
        "date": "2026-11-27",
        "machine_info": {"cpu": "x86_64", "threads": 2, "torch": "2.13.0+cpu", "transformers": "5.23.0"},
        "device": "cpu",
        "dtype": "float32",
        "settings": {"repeats": 3},
        "results": [{"train_ms_per_step": 1.5}],
    }


def test_a_good_record_passes_and_each_fault_is_named():
    check_result(good_record())
    faults = {
        "missing command": lambda r: r.pop("command"),
        "unknown field(s) summary": lambda r: r.update(summary={}),
        "commit 'unknown' is not a git revision": lambda r: r.update(commit="unknown"),
        "date '27/11/2026' is not ISO 8601": lambda r: r.update(date="27/11/2026"),
        "machine_info lacks gpu": lambda r: r.update(device="cuda"),
        "machine_info holds git_sha": lambda r: r["machine_info"].update(git_sha="4b3ba45"),
        "settings must be an object": lambda r: r.update(settings=None),
        "dtype is null": lambda r: r.update(dtype=None),
        "command is null without a provenance_note": lambda r: r.update(command=None),
    }
    for message, fault in faults.items():
        record = good_record()
        fault(record)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_result(record)


def test_a_null_field_needs_a_note_that_says_why():
    record = good_record() | {"command": None, "provenance_note": "recovered from git history"}
    with pytest.raises(ValueError, match="command is null"):
        check_result(record)
    record["provenance_note"] = "command: null, the run recorded none and no document writes it out"
    check_result(record)


def test_result_record_moves_the_machine_lines_revision_and_day_to_the_record():
    info = {"cpu": "x86_64", "cores": 2, "threads": 2, "torch": "2", "transformers": "5", "device": "cpu"}
    info |= {"date": "2026-11-27", "git_sha": "abc1234"}
    record = result_record("python x.py", {"output_dir": Path("out")}, [1.0], device="cpu", dtype="float32", info=info)
    assert record["commit"] == "abc1234" and record["date"] == "2026-11-27" and record["device"] == "cpu"
    assert record["machine_info"] == {"cpu": "x86_64", "cores": 2, "threads": 2, "torch": "2", "transformers": "5"}
    assert record["settings"] == {"output_dir": "out"}  # as saved: paths as strings
    outside = info | {"git_sha": "unknown"}
    outside_git = result_record("python x.py", {}, [], device="cpu", dtype="float32", info=outside)
    assert outside_git["commit"] is None and "commit: null" in outside_git["provenance_note"]


def test_command_line_is_the_command_as_typed_from_the_repository_root():
    script = BENCHMARKS.parent / "scripts" / "benchmarks" / "benchmark_scan.py"
    assert command_line(script, ["--repeats", 3, "--cases", "a b"]) == (
        "python scripts/benchmarks/benchmark_scan.py --repeats 3 --cases 'a b'"
    )
