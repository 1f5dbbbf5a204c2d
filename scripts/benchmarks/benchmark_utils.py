"""What the benchmark scripts share: the machine line, the one result format, peak-memory readings, one measurement
per process."""

import datetime
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the flags' ranges
from argument_checks import in_range  # noqa: E402


# argparse `type=`s of the benchmarks' numeric flags, so that a zero size, count or repeat is refused naming the flag
# instead of dividing by zero or measuring nothing.
POSITIVE = in_range(int, at_least=1)  # sizes, lengths, steps, repeats, threads
NON_NEGATIVE = in_range(int, at_least=0)  # seeds, indices, warmup steps
POSITIVE_FLOAT = in_range(float, above=0)  # learning rates, seconds
NON_NEGATIVE_FLOAT = in_range(float, at_least=0)
FRACTION = in_range(float, at_least=0, below=1)  # dropout

# RANConfig's default dropout, as a training step runs it (sized_ran_config turns dropout off).
TRAINING_DROPOUT = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}


def sized_ran_config(args, window_size: int | None = None, vocab_size: int | None = None, **fields):
    """The `RANConfig` a benchmark's size flags give (`--hidden_size`, `--num_layers`, `--num_heads`,
    `--window_size`, `--vocab_size` where the script has one, else 1000): head size hidden / heads, the shortest
    window a quarter of the window and at most 16, dropout off. `fields` set any other field or override these."""
    from ran_hf import RANConfig  # imported here: scripts that time their imports pay for it where they measure

    window_size = window_size or args.window_size
    sizes = {
        "vocab_size": vocab_size or getattr(args, "vocab_size", 1000),
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "head_dim": args.hidden_size // args.num_heads,
        "window_size": window_size,
        "min_window_size": min(16, window_size // 4),
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    return RANConfig(**{**sizes, **fields})


def machine_info(device: str = "cpu") -> dict:
    """CPU/GPU, library versions and the git revision: printed first and saved with every result."""
    import transformers

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["git_sha"] = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_sha"] = "unknown"
    return info


# The one result format: every benchmark JSON is one record with exactly these fields, made by `result_record` and
# checked by `check_result` (tests/test_result_files.py checks every file under benchmarks/).
RESULT_FIELDS = {
    "command": "the exact command line that wrote the file, run from the repository root (str)",
    "commit": "the git revision the run started from, as `git rev-parse --short HEAD` prints it (str)",
    "date": "the UTC day of the run, ISO 8601: YYYY-MM-DD, a time may follow (str)",
    "machine_info": "the machine: cpu, threads (torch's), torch, transformers, gpu where one was used; may add more "
    "(dict)",
    "device": "where the model ran: cpu, cuda, meta (str)",
    "dtype": "what the model computed in: float32, bfloat16; 'bfloat16 autocast' for float32 weights under "
    "torch.autocast, 'float32 vs bfloat16 autocast' where a run compares both, 'none' where no model runs (str)",
    "settings": "the run's arguments (dict)",
    "results": "the figures (any JSON)",
}
OPTIONAL_RESULT_FIELDS = {
    "provenance_note": "for a file whose provenance was recovered after the run: where each recovered field came "
    "from, and for a field left null, '<field>: null' and why (str)",
}
# Fields a file may leave null, only with a `provenance_note` that says '<field>: null' and why.
NULLABLE_RESULT_FIELDS = ("command", "commit", "date")
MACHINE_FIELDS = ("cpu", "threads", "torch", "transformers")  # and "gpu" on CUDA
RUN_FIELDS = ("git_sha", "date", "device")  # what `machine_info()` adds for the machine line; the record has its own


def command_line(script: str | Path, argv: list | None = None) -> str:
    """The command that ran `script` (a script's `__file__`) with `argv` (default: this process's arguments), as
    typed from the repository root, quoted as a shell needs."""
    path = Path(script).resolve()
    root = Path(__file__).resolve().parents[2]
    if path.is_relative_to(root):
        path = path.relative_to(root)
    arguments = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", str(path), *map(str, arguments)])


def result_record(command: str, settings: dict, results, *, device: str, dtype: str, info: dict | None = None) -> dict:
    """One benchmark result in the one format (`RESULT_FIELDS`): `info` is the `machine_info()` the run printed
    (taken now if not given), whose revision, day and device become the record's `commit`, `date` and `device`.
    Paths and other objects in `settings` and `results` are saved as their strings."""
    info = dict(info or machine_info(device))
    commit, date = info.pop("git_sha", None), info.pop("date", None)
    info.pop("device", None)
    record = {
        "command": command,
        "commit": None if commit in (None, "unknown") else commit,
        "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine_info": info,
        "device": str(device),
        "dtype": dtype,
        "settings": json.loads(json.dumps(settings, default=str)),
        "results": json.loads(json.dumps(results, default=str)),
    }
    if record["commit"] is None:
        record["provenance_note"] = "commit: null, the run's folder was not a git checkout"
    check_result(record)
    return record


def check_result(record) -> None:
    """Raise ValueError naming what does not fit the one result format (`RESULT_FIELDS`)."""
    problems = []
    if not isinstance(record, dict):
        raise ValueError(f"a result is a JSON object, not {type(record).__name__}")
    missing = [field for field in RESULT_FIELDS if field not in record]
    unknown = [field for field in record if field not in RESULT_FIELDS and field not in OPTIONAL_RESULT_FIELDS]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)} (figures go under results, arguments under settings)")
    note = record.get("provenance_note")
    if "provenance_note" in record and not (isinstance(note, str) and note.strip()):
        problems.append("provenance_note must be a non-empty string")
    for field in ("command", "commit", "date", "device", "dtype"):
        value = record.get(field)
        if value is None:
            if field in record and (field not in NULLABLE_RESULT_FIELDS or f"{field}: null" not in str(note)):
                problems.append(f"{field} is null without a provenance_note saying '{field}: null' and why")
        elif not isinstance(value, str) or not value.strip():
            problems.append(f"{field} must be a non-empty string, not {value!r}")
    commit, date = record.get("commit"), record.get("date")
    if isinstance(commit, str) and not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        problems.append(f"commit {commit!r} is not a git revision")
    if isinstance(date, str):
        try:
            datetime.datetime.fromisoformat(date)
        except ValueError:
            problems.append(f"date {date!r} is not ISO 8601 (YYYY-MM-DD)")
    machine = record.get("machine_info")
    if not isinstance(machine, dict):
        problems.append("machine_info must be an object")
    else:
        needed = MACHINE_FIELDS + (("gpu",) if str(record.get("device", "")).startswith("cuda") else ())
        if absent := [key for key in needed if machine.get(key) in (None, "")]:
            problems.append(f"machine_info lacks {', '.join(absent)}")
        if doubled := [key for key in RUN_FIELDS if key in machine]:
            problems.append(f"machine_info holds {', '.join(doubled)}: the record's commit, date and device say it")
    if not isinstance(record.get("settings"), dict):
        problems.append("settings must be an object")
    if problems:
        raise ValueError("; ".join(problems))


RESULT_SUFFIXES = (".json", ".md", ".png")


def result_path(prefix: str | Path, suffix: str) -> Path:
    """The result file `prefix` + `suffix` of an `--output` prefix. A prefix with dots in its name keeps them
    (`recall_lr0.006` -> `recall_lr0.006.json`), where `Path.with_suffix` would cut `.006` off and two runs would
    write the same files; a prefix that already ends in a result suffix drops it."""
    prefix = Path(prefix)
    if prefix.suffix in RESULT_SUFFIXES:
        prefix = prefix.with_suffix("")
    return prefix.with_name(prefix.name + suffix)


def write_result(path: Path, text: str) -> None:
    """Write a result file whole or not at all: into a sibling first, then renamed over the old one, so that a run
    stopped mid-write leaves the earlier file as it was."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def write_json_and_table(prefix: str | Path, result: dict, table: str) -> None:
    """A run's result file (`prefix`.json) and its table (`prefix`.md), each written whole or not at all."""
    write_result(result_path(prefix, ".json"), json.dumps(result, indent=2) + "\n")
    write_result(result_path(prefix, ".md"), table)


def machine_line(info: dict) -> str:
    hardware = info.get("gpu") or f"{info['cpu']} x{info['threads']} threads"
    return f"{hardware} | torch {info['torch']} | transformers {info['transformers']} | git {info['git_sha']}"


class PeakMemory:
    """Peak memory of the work done since `reset()`: CUDA's allocator peak, or on CPU the growth of resident memory.

    On CPU the process's resident size only ever reaches a new maximum, so readings are meaningful in a fresh
    process, taken in order of growing work (inference, then training).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/statm") as statm:
                self.baseline = int(statm.read().split()[1]) * resource.getpagesize()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.baseline)


class LiveTensorPeak(TorchDispatchMode):
    """The most bytes held at once by tensors created inside this context: exact, and blind to the allocator.

    Every operator's outputs are seen here; each storage is counted once, from its creation until it is freed. On
    CPU the resident size (`PeakMemory`) also counts what the allocator keeps for reuse and what a warm-up already
    grew, so it moves by tens of MiB between runs of the same code; this count does not. Tensors alive before the
    context (parameters, inputs) are not counted.
    """

    def __init__(self):
        super().__init__()
        self.storage_bytes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _release(self, address: int) -> None:
        self.live_bytes -= self.storage_bytes.pop(address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        outputs = func(*args, **(kwargs or {}))
        input_addresses = None
        for tensor in tree_leaves(outputs):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or address in self.storage_bytes:
                continue
            if input_addresses is None:  # a view or an in-place result shares an input's storage: not new
                leaves = tree_leaves((args, kwargs))
                input_addresses = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
            if address in input_addresses:
                continue
            self.storage_bytes[address] = size
            self.live_bytes += size
            weakref.finalize(storage, self._release, address)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return outputs


def run_in_subprocess(script: str, arguments: list, timeout: float | None = None) -> dict:
    """Run `script --single ...` in a fresh interpreter and return the JSON it prints on its last line."""
    command = [sys.executable, script, *arguments]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if completed.returncode < 0:  # killed by a signal: on a CPU machine, almost always the kernel's OOM killer
        return {"error": f"killed by signal {-completed.returncode} (out of memory?)"}
    if completed.returncode != 0:
        lines = [line for line in completed.stderr.splitlines() if "Error" in line] or completed.stderr.splitlines()
        return {"error": (lines or ["failed"])[-1].strip()[:200]}
    return json.loads(completed.stdout.strip().splitlines()[-1])
