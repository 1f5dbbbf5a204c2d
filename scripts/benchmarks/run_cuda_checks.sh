#!/usr/bin/env bash
# The CUDA checks of the GPU work in one run on one H100 or H200 (docs/gpu.md, "The GPU run"): the Triton kernels'
# tests compiled, the bf16 gradients against the reference scan, a BERT-base MLM training step (bf16 autocast) at
# 8 x 8K and 2 x 32K beside the same-size windowed transformer, ModernBERT and Longformer, with peak memory and the
# top 15 kernels, and the causal RAN's per-token decoding latency and cache bytes at 512 and 64K tokens of context.
#   bash scripts/benchmarks/run_cuda_checks.sh OUT_DIR            # on the GPU machine: under 8 minutes
#   bash scripts/benchmarks/run_cuda_checks.sh --smoke OUT_DIR    # every part on the CPU at tiny sizes (~3 minutes)
# PYTHON names the interpreter (default: the clone's .venv/bin/python where scripts/setup.sh made one, else python).
# The run exits 1 when any part failed. Every file goes under OUT_DIR: each part's log (headed by the
# device, commit, command and dtype), the result JSONs in the one result format (benchmark_utils.result_record), and
# status.txt, one line per part: its exit code (124: stopped by its time limit), seconds taken and limit.
# The smoke run's figures are CPU figures of tiny models: they check that the run works, and measure nothing.
#
# Parts, most important first, each under its own `timeout` so that a slow part leaves the others their time.
# Planned limits in seconds (plans, not measurements), 478 in all with 2 s each to stop:
#   gpu           10  nvidia-smi: the card, its memory, the driver (skipped in the smoke run)
#   tests_scan   130  tests/test_triton_scan.py, tests/test_devices.py compiled on CUDA, --run-slow (fp32, bf16)
#   tests_tokens  55  tests/test_triton_{norm,glu,rotary,window_projection}.py compiled, --run-slow (fp32, fp16)
#   step_8k      105  profile_step.py 8 x 8192: RAN (Triton scan), transformer, ModernBERT, Longformer, RAN (fused
#                     scan), RAN (Triton scan, token-wise ops in PyTorch): step, peak memory, top 15 kernels
#   bf16          40  benchmark_bf16_gradients.py: every head's gradient error under bf16 autocast, per scan
#   step_32k      45  profile_step.py 2 x 32768: RAN (Triton scan), transformer
#   decode        40  benchmark_decode.py: causal RAN and GPT-2, per-token latency and cache bytes, 512 and 65536
#   decode_review 25  the same for RAN reviewing the cells of its last 8 windows only (a flat cache), no GPT-2
#   report        10  the tests' JSONs, the bf16 check (each scan <= 2x the reference scan's error) and every
#                     result JSON checked against the result format (status lines bf16_check and results_check)
set -uo pipefail
smoke=0
if [[ ${1:-} == --smoke ]]; then
    smoke=1
    shift
fi
out=${1:?usage: run_cuda_checks.sh [--smoke] OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
python=${PYTHON:-}
if [[ -z $python ]]; then  # the clone's own environment, as scripts/setup.sh makes it, before whatever is on PATH
    python=python
    [[ -x .venv/bin/python ]] && python=$root/.venv/bin/python
fi
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
: > "$out/status.txt"
: > "$out/commands.txt"
this_run="bash scripts/benchmarks/run_cuda_checks.sh$([[ $smoke == 1 ]] && echo ' --smoke') $out"

if [[ $smoke == 1 ]]; then
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1  # the CPU, and the Triton kernels in Triton's interpreter
    device=cpu
    workers=(-n 0)
    scan_tests="test_triton_scan_equals_the_reference and encoder-one-sequence or bf16_autocast and cpu-triton"
    scan_tests=(-k "$scan_tests or triton and cpu and encoder and not overlap and not padding")
    token_tests=(-k "float32-3x7x24 or layer-norm] or float32-8-keys or encoder-padding-merged-tail")
    sizes=(--hidden_size 64 --num_layers 2 --num_heads 4 --vocab_size 1000)
    step=("${sizes[@]}" --window_size 64 --repeats 1 --warmups 1 --modernbert_window 16 --longformer_window 64)
    shape_8k=1x128
    shape_32k=1x256
    bf16=(--hidden_size 32 --num_layers 1 --num_heads 4 --window_size 16 --length 32 --vocab_size 300
        --scans reference triton)
    decode=("${sizes[@]}" --window_size 32 --contexts 128 512 --steps 32 --gpt2_steps 4 --gpt2_max_context 512
        --prefill_chunk 256)
    scale=2  # each part's limit doubled: a CPU shared with other work, and the kernels interpreted
else
    device=cuda
    workers=()
    if "$python" -c "import xdist" > /dev/null 2>&1; then
        workers=(-n 4)  # compiling the kernels is CPU work: four workers compile side by side
    fi
    scan_tests=()
    token_tests=()
    sizes=(--hidden_size 768 --num_layers 12 --num_heads 12 --window_size 256 --vocab_size 30522)
    step=("${sizes[@]}" --repeats 3 --warmups 2 --modernbert_window 128 --longformer_window 512)
    shape_8k=8x8192
    shape_32k=2x32768
    bf16=(--hidden_size 768 --num_layers 2 --num_heads 12 --window_size 64 --length 512 --vocab_size 1000
        --scans reference fused triton)
    decode=("${sizes[@]}" --contexts 512 65536 --steps 256 --gpt2_steps 16
        --gpt2_max_context 65536 --prefill_chunk 8192)
    scale=1
fi

# run_part NAME LIMIT DTYPE COMMAND...: COMMAND from the repository root under `timeout LIMIT`, its output in
# OUT_DIR/NAME.log after a header naming the device, commit, command (or $shown) and dtype; its exit code in
# status.txt.
run_part() {
    local name=$1 limit=$(($2 * scale)) dtype=$3
    shift 3
    local command=${shown:-$(printf '%q ' "$@")}
    printf '%s\t%s\n' "$name" "${command% }" >> "$out/commands.txt"
    {
        echo "# part $name of: $this_run"
        echo "# device: $device$([[ $smoke == 1 ]] && echo ' (smoke run: CPU figures, not GPU ones)')"
        echo "# commit: $commit; dtype: $dtype; limit: $limit s; started $(date -u +%FT%TZ)"
        echo "# command, from the repository root: ${command% }"
    } > "$out/$name.log"
    local start=$SECONDS
    timeout -k 2 "$limit" "$@" >> "$out/$name.log" 2>&1
    local code=$?
    echo "$name exit $code seconds $((SECONDS - start)) limit $limit" >> "$out/status.txt"
}

if [[ $smoke == 0 ]]; then
    run_part gpu 10 none nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
tests=(-m pytest -q -p no:cacheprovider --run-slow --durations=20 "${workers[@]}")
run_part tests_scan 130 "float32; bfloat16 autocast" "$python" "${tests[@]}" --junitxml="$out/tests_scan.xml" \
    "${scan_tests[@]}" tests/test_triton_scan.py tests/test_devices.py
run_part tests_tokens 55 "float32, float16" "$python" "${tests[@]}" --junitxml="$out/tests_tokens.xml" \
    "${token_tests[@]}" tests/test_triton_norm.py tests/test_triton_glu.py tests/test_triton_rotary.py \
    tests/test_triton_window_projection.py
run_part step_8k 105 "bfloat16 autocast" "$python" scripts/benchmarks/profile_step.py --device "$device" \
    --shape "$shape_8k" "${step[@]}" --top_kernels 15 --output_dir "$out" \
    --models ran-triton transformer modernbert longformer ran-fused ran-triton+pytorch-token-ops
run_part bf16 40 "float32 vs bfloat16 autocast" "$python" scripts/benchmarks/benchmark_bf16_gradients.py \
    --device "$device" "${bf16[@]}" --seeds 0 --output_dir "$out"
run_part step_32k 45 "bfloat16 autocast" "$python" scripts/benchmarks/profile_step.py --device "$device" \
    --shape "$shape_32k" "${step[@]}" --top_kernels 15 --output_dir "$out" --models ran-triton transformer
run_part decode 40 "bfloat16 autocast" "$python" scripts/benchmarks/benchmark_decode.py --device "$device" \
    --bf16_autocast "${decode[@]}" --output_dir "$out"
run_part decode_review 25 "bfloat16 autocast" "$python" scripts/benchmarks/benchmark_decode.py --device "$device" \
    --bf16_autocast "${decode[@]}" --memory_review_cells 8 --gpt2_max_context 1 --output_dir "$out"

# The report: each test part's JUnit XML as a result JSON; the bf16 check; every result JSON against the format.
report=$(cat <<'PYTHON'
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, "scripts/benchmarks")
from benchmark_utils import check_result, machine_info, result_record  # noqa: E402

out, device, this_run = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
info = machine_info(device)
status = out / "status.txt"
exits = {line.split()[0]: int(line.split()[2]) for line in status.read_text().splitlines() if " exit " in line}
commands = dict(line.split("\t", 1) for line in (out / "commands.txt").read_text().splitlines())

for part, dtype in (("tests_scan", "float32; bfloat16 autocast"), ("tests_tokens", "float32, float16")):
    if part not in commands:
        continue
    results = {"exit_code": exits.get(part)}
    xml = out / f"{part}.xml"
    if xml.exists():
        suite = ElementTree.parse(xml).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        cases = suite.findall("testcase")
        failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
        skipped = [c for c in cases if c.find("skipped") is not None]
        name = lambda case: f"{case.get('classname')}::{case.get('name')}"  # noqa: E731
        results.update({
            "tests": len(cases), "passed": len(cases) - len(failed) - len(skipped), "failed": len(failed),
            "skipped": len(skipped), "seconds": float(suite.get("time", 0)),
            "failures": [name(case) for case in failed],
            "slowest": [[name(c), float(c.get("time", 0))]
                        for c in sorted(cases, key=lambda c: -float(c.get("time", 0)))[:10]],
        })  # fmt: skip
    else:
        results["error"] = "no JUnit report: pytest was stopped before it finished (see the log)"
    record = result_record(commands[part], {"part": part, "run": this_run}, results, device=device, dtype=dtype,
                           info=info)  # fmt: skip
    (out / f"{part}.json").write_text(json.dumps(record, indent=2))

# Every scan's largest gradient error under bf16 autocast within 2x the reference scan's own, head by head (max
# pooling's error with the float32 pass's choice of tokens kept, as benchmark_bf16_gradients.py measures it).
source = out / f"bf16_{device}.json"
rows, problems = [], []
if source.exists():
    measured = json.loads(source.read_text())["results"]
    for head in dict.fromkeys(row["head"] for row in measured):
        mine = [row for row in measured if row["head"] == head]
        metric = "max_same_choice" if all("max_same_choice" in row for row in mine) else "max"
        worst = {}
        for row in mine:
            worst[row["model"]] = max(worst.get(row["model"], 0.0), row[metric])
        reference = worst.get("ran-reference")
        for model, error in worst.items():
            if not model.startswith("ran-") or model == "ran-reference" or reference is None:
                continue
            within = error <= 2 * reference
            rows.append({"head": head, "model": model, "metric": metric, "error": error,
                         "reference_scan_error": reference, "encoder_error": worst.get("transformer-encoder"),
                         "ratio": error / reference if reference else None, "within_2x": within})  # fmt: skip
            if not within:
                problems.append(f"{head} {model}: {error:.2%} against the reference scan's {reference:.2%}")
    if not rows:
        problems.append("no scan to compare with the reference scan")
else:
    problems.append(f"{source.name} was not written (see bf16.log)")
settings = {"source": source.name, "bound": "error <= 2 x the reference scan's error under bf16 autocast"}
record = result_record(this_run, settings, {"rows": rows, "problems": problems}, device=device,
                       dtype="float32 vs bfloat16 autocast", info=info)  # fmt: skip
(out / "bf16_check.json").write_text(json.dumps(record, indent=2))
for problem in problems:
    print("bf16 check:", problem)

bad = []
for path in sorted(out.glob("*.json")):
    try:
        check_result(json.loads(path.read_text()))
    except (ValueError, json.JSONDecodeError) as error:
        bad.append(f"{path.name}: {error}")
for problem in bad:
    print("result format:", problem)
with status.open("a") as file:
    file.write(f"bf16_check exit {int(bool(problems))}\n")
    file.write(f"results_check exit {int(bool(bad))} files {len(list(out.glob('*.json')))}\n")
PYTHON
)
shown="$python -c <the report in run_cuda_checks.sh> $out $device" run_part report 10 none \
    "$python" -c "$report" "$out" "$device" "$this_run"
cat "$out/status.txt"
# A part that failed fails the run: a run whose parts all failed exited 0 before, as if it had measured.
failed=$(awk '$2 == "exit" && $3 != 0 {print $1}' "$out/status.txt" | tr '\n' ' ')
if [[ -n $failed ]]; then
    echo "parts that failed (see their logs in $out): $failed" >&2
    exit 1
fi
