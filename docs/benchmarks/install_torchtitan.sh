#!/usr/bin/env bash
# Build the virtual environment of torchtitan's MoE layer for
# `moeflow bench layer --compare torchtitan --peer-python VENV/bin/python`
# (docs/benchmarks/layer.md, "torchtitan and Megatron-core").
#
# torchtitan is not on the package index: pass its source tree (a clone of
# github.com/pytorch/torchtitan; the comparison was set up at commit b5bcd76). This script
# fetches nothing but the index packages below, so it also runs where the source was copied in.
#
# The venv sees the system site-packages (torch 2.13 CPU, numpy, triton where installed) and
# gets its own spmd_types, tyro, einops (+ tyro's docstring-parser and typeguard), which
# torchtitan imports; torchtitan itself goes on the venv's path by a .pth file pointing at the
# source (no build, no dependency resolution that could replace torch). torchtitan imports
# triton at import time (a GPU-only expert-parallel module): installed from the index when the
# system has none. Idempotent.
#
# Usage: bash docs/benchmarks/install_torchtitan.sh TORCHTITAN_SOURCE [VENV]
#        (default VENV /opt/torchtitan-venv)
set -euo pipefail

SRC=${1:?usage: install_torchtitan.sh TORCHTITAN_SOURCE [VENV]}
VENV=${2:-/opt/torchtitan-venv}
PY_SYSTEM=${PY_SYSTEM:-python3}
SRC=$(cd "${SRC}" && pwd)
if [ ! -f "${SRC}/torchtitan/models/common/moe.py" ]; then
    echo "${SRC} is not a torchtitan source tree (no torchtitan/models/common/moe.py)" >&2
    exit 1
fi

if [ ! -x "${VENV}/bin/python" ]; then
    "${PY_SYSTEM}" -m venv --system-site-packages "${VENV}"
fi
PIP=("${VENV}/bin/python" -m pip)
# --no-deps: torch stays the system's
"${PIP[@]}" install --no-deps spmd_types tyro einops docstring-parser typeguard
if ! "${VENV}/bin/python" -c "import triton" 2>/dev/null; then
    "${PIP[@]}" install --no-deps triton
fi
SITE=$("${VENV}/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "${SRC}" > "${SITE}/torchtitan_source.pth"

"${VENV}/bin/python" - <<'PY'
import torch
import torchtitan.models.common.moe as moe
import torchtitan.models.common.token_dispatcher as td
print("torch", torch.__version__, "| torchtitan from", moe.__file__)
PY
echo "done: moeflow bench layer --compare torchtitan --peer-python ${VENV}/bin/python ..."
