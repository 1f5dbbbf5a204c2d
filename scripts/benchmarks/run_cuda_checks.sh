#!/usr/bin/env bash
# The CUDA checks of the GPU work, in one go (docs/gpu.md): the Triton kernels' tests compiled, then one BERT-base
# MLM training step profiled at 8 x 8K and 2 x 32K for RAN's scans and the same-size windowed transformer.
#   bash scripts/benchmarks/run_cuda_checks.sh OUT_DIR
# Each part has its own time limit, so that a slow part leaves the others their time.
set -uo pipefail
out=${1:?usage: run_cuda_checks.sh OUT_DIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/../.." && pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
cd "$root/scripts/benchmarks"
timeout 130 python profile_step.py --device cuda --shape 8x8192 --output_dir "$out" \
    --models ran-fused ran-triton ran-triton+tokens transformer > "$out/profile_8x8192.log" 2>&1
echo "8x8192 exit $?" >> "$out/status.txt"
timeout 130 python profile_step.py --device cuda --shape 2x32768 --output_dir "$out" \
    --models ran-triton ran-triton+tokens transformer > "$out/profile_2x32768.log" 2>&1
echo "2x32768 exit $?" >> "$out/status.txt"
cd "$root"
timeout 200 python -m pytest -q -p no:cacheprovider --run-slow tests/test_triton_scan.py tests/test_triton_rotary.py \
    tests/test_triton_norm.py > "$out/triton_cuda_tests.log" 2>&1
echo "tests exit $?" >> "$out/status.txt"
