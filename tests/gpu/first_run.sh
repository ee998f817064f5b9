#!/usr/bin/env bash
# The first run on one GPU (docs/gpu.md, "First run on one GPU"): the Triton codec suite, the
# GPU tests one device can run, the NCCL / two-stream / CUDA-graph probes, and moeflow train
# with a SIGUSR1 preemption and --resume, within 8 minutes; one report, <out>/report.md.
#   bash tests/gpu/first_run.sh [--out first-run] [--budget-s 480] [--device cuda|cpu]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python -m tests.gpu.first_run "$@"
