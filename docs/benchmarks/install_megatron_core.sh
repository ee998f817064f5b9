#!/usr/bin/env bash
# Build the virtual environment of Megatron-core 0.19.2's MoE layer for
# `moeflow bench layer --compare megatron --peer-python VENV/bin/python`
# (docs/benchmarks/layer.md, "torchtitan and Megatron-core").
#
# megatron-core 0.19.2 ships only CPython 3.12 wheels (Requires-Python >= 3.12). Two ways:
#
# 1. With a CPU build of torch for cp312 (a wheel file given as TORCH_CP312_WHEEL, e.g. from
#    PyTorch's CPU wheel index where it is reachable): a python3.12 venv with that torch and
#    megatron-core installed by pip (--no-deps; numpy and packaging from the index).
# 2. Without one (the default): the package index's cp312 torch is the CUDA build (527 MB,
#    plus several GB of nvidia-* libraries without which `import torch` fails on
#    libcudnn.so.9), so instead the venv is one of the system Python (3.11, with its torch 2.13
#    CPU via --system-site-packages) and megatron-core 0.19.2's wheel is unpacked into it: its
#    code is pure Python (every module parses under 3.11) but for one compiled dataset helper
#    (megatron/core/datasets/helpers_cpp, cp312) that the MoE layer never imports.
#
# The CPU shims the runner applies (CUDA stream at the dispatcher's construction, the router's
# current CUDA device, the device-to-host copy of the counts) are in
# benchmarks/peers/megatron_runner.py, in that process only; nothing installed is patched.
# Idempotent.
#
# Usage: bash docs/benchmarks/install_megatron_core.sh [VENV] [TORCH_CP312_WHEEL]
#        (default VENV /opt/megatron-core-venv)
set -euo pipefail

VENV=${1:-/opt/megatron-core-venv}
TORCH_WHEEL=${2:-}
DL=${VENV}/downloads

if [ -n "${TORCH_WHEEL}" ]; then
    PY312=${PY312:-python3.12}
    if [ ! -x "${VENV}/bin/python" ]; then
        "${PY312}" -m venv "${VENV}"
    fi
    "${VENV}/bin/python" -m pip install "${TORCH_WHEEL}"
    "${VENV}/bin/python" -m pip install --no-deps "megatron-core==0.19.2" numpy packaging
else
    PY_SYSTEM=${PY_SYSTEM:-python3}
    if [ ! -x "${VENV}/bin/python" ]; then
        "${PY_SYSTEM}" -m venv --system-site-packages "${VENV}"
    fi
    mkdir -p "${DL}"
    WHEEL=$(ls "${DL}"/megatron_core-0.19.2-cp312-*.whl 2>/dev/null | head -1 || true)
    if [ -z "${WHEEL}" ]; then
        "${VENV}/bin/python" -m pip download --no-deps --only-binary :all: \
            --python-version 3.12 "megatron-core==0.19.2" -d "${DL}"
        WHEEL=$(ls "${DL}"/megatron_core-0.19.2-cp312-*.whl | head -1)
    fi
    SITE=$("${VENV}/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    case "${SITE}" in "${VENV}"/*) ;; *) echo "refusing to unpack into ${SITE}" >&2; exit 1;; esac
    "${VENV}/bin/python" -m zipfile -e "${WHEEL}" "${SITE}"
fi

"${VENV}/bin/python" - <<'PY'
import importlib.metadata as md
import torch
from megatron.core.transformer.moe import moe_layer, token_dispatcher  # noqa: F401
print("torch", torch.__version__, "| megatron-core", md.version("megatron-core"))
PY
echo "done: moeflow bench layer --compare megatron --peer-python ${VENV}/bin/python ..."
