"""The main job's metrics: `scripts/run_pipeline.py` run once as a fresh process, its `pipeline_results.json` recorded
as a result file with the command, commit, date and machine. docs/training.md and the README quote these figures,
and tests/test_doc_figures.py checks them against the file. Its time is measured by `benchmark_commands.py`
(benchmarks/commands/run_pipeline.*), over several runs; the wall time here is the one run's.

    python scripts/benchmarks/record_main_job.py --output benchmarks/commands/run_pipeline_metrics

Arguments after `--` go to run_pipeline.py (real data, say); without them it runs on its built-in synthetic data.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmark_utils import command_line, machine_info, result_record, write_json_and_table


ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("validation", "test")
SHOWN = ("accuracy", "macro_f1", "loss")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    own, pipeline_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="result prefix: writes PREFIX.json and PREFIX.md")
    args = parser.parse_args(own)
    info = machine_info()
    with tempfile.TemporaryDirectory(prefix="main-job-") as folder:
        command = [sys.executable, str(ROOT / "scripts" / "run_pipeline.py"), "--output_dir", folder, *pipeline_args]
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            sys.exit(f"run_pipeline.py exited {completed.returncode}:\n{completed.stderr[-3000:]}")
        summary = json.loads((Path(folder) / "pipeline_results.json").read_text())
    summary.pop("output_dir")  # a temporary folder, gone
    settings = {"output": args.output, "run_pipeline_arguments": pipeline_args}
    result = result_record(command_line(__file__, argv), settings, summary, device="cpu", dtype="float32", info=info)

    machine = result["machine_info"]
    lines = [f"# {Path(args.output).name}", "", f"`{result['command']}`", ""]
    lines += [f"commit {result['commit']}, {result['date']}, {machine['cpu']}, {machine['cores']} cores", ""]
    lines += [f"One run of `{' '.join(['scripts/run_pipeline.py', *pipeline_args])}`:", ""]
    lines += ["| split | " + " | ".join(SHOWN) + " |", "|---|" + "---:|" * len(SHOWN)]
    for split in SPLITS:
        values = [summary[split].get(f"{'eval' if split == 'validation' else 'test'}_{name}") for name in SHOWN]
        lines.append(f"| {split} | " + " | ".join("–" if v is None else f"{v:.4f}" for v in values) + " |")
    lines += ["", f"Masked-LM perplexity on held-out training text: {summary['mlm_perplexity']:.2f}."]
    lines += [f"Wall time of this run, in the job: {summary['wall_time_s']} s.", ""]
    text = "\n".join(lines)
    print(text)
    write_json_and_table(args.output, result, text)
    return result


if __name__ == "__main__":
    main()
