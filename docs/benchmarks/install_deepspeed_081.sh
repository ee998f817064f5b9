#!/usr/bin/env bash
# Install DeepSpeed 0.8.1 (the Parm paper's baseline, Section V footnote 1) into an isolated venv
# for `moeflow bench parm --compare deepspeed` (docs/benchmarks/parm.md, "DeepSpeed 0.8.1 itself").
#
# The system environment is left as it is: the venv sees the system site-packages (torch 2.13
# CPU, numba, tqdm, hjson, ninja, py-cpuinfo, psutil, packaging) but gets its own numpy < 2 and
# pydantic < 2 (which 0.8.1 needs) and its own deepspeed 0.8.1, which shadow the system ones
# inside the venv only. Idempotent: re-running skips the steps already done.
#
# One source patch, in the venv's copy only: 0.8.1 imports `inf` from `torch._six`, which
# torch 2.x removed. The files that do so (listed by the grep below, for 0.8.1:
#   deepspeed/runtime/utils.py
#   deepspeed/runtime/zero/stage_1_and_2.py
#   deepspeed/runtime/zero/stage3.py)
# get `from torch._six import inf` -> `from torch import inf` (the same float('inf')).
#
# Usage: bash docs/benchmarks/install_deepspeed_081.sh [VENV_DIR]   (default /opt/ds081)
set -euo pipefail

VENV=${1:-/opt/ds081}
PY_SYSTEM=${PY_SYSTEM:-python3}
DL=${VENV}/downloads
SDIST=${DL}/deepspeed-0.8.1.tar.gz

if [ ! -x "${VENV}/bin/python" ]; then
    "${PY_SYSTEM}" -m venv --system-site-packages "${VENV}"
fi
PIP=("${VENV}/bin/python" -m pip)
mkdir -p "${DL}"

# numpy < 2 and pydantic < 2, in the venv only (--no-deps: torch stays the system's); wheel,
# because the venv's own setuptools (65.x, bundled by venv) shadows the system's and has no
# bdist_wheel of its own
"${PIP[@]}" install --no-deps "numpy<2" "pydantic<2" wheel

# DeepSpeed 0.8.1 from its sdist, no ops built ahead of time, no dependency resolution
if [ ! -f "${SDIST}" ]; then
    "${PIP[@]}" download --no-deps --no-binary :all: "deepspeed==0.8.1" -d "${DL}"
fi
if ! "${VENV}/bin/python" -c "import importlib.metadata as m; assert m.version('deepspeed') == '0.8.1'" 2>/dev/null; then
    DS_BUILD_OPS=0 "${PIP[@]}" install --no-build-isolation --no-deps "${SDIST}"
fi

# torch._six -> torch (inf), in the venv's deepspeed only
SITE=$("${VENV}/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DSDIR=${SITE}/deepspeed
case "${DSDIR}" in "${VENV}"/*) ;; *) echo "refusing to patch ${DSDIR}: not inside ${VENV}" >&2; exit 1;; esac
FILES=$(grep -rl --include='*.py' 'from torch._six import inf' "${DSDIR}" || true)
for f in ${FILES}; do
    sed -i 's/from torch\._six import inf/from torch import inf/' "${f}"
    echo "patched torch._six in ${f#"${SITE}"/}"
done
if grep -rn --include='*.py' 'torch\._six' "${DSDIR}"; then
    echo "torch._six still referenced above: patch by hand" >&2
    exit 1
fi

# check: the venv's versions, the system's torch, and that deepspeed's MoE imports
"${VENV}/bin/python" - <<'EOF'
import numpy, pydantic, torch, deepspeed
from deepspeed.moe.layer import MoE  # noqa: F401
from deepspeed.moe import sharded_moe  # noqa: F401
assert deepspeed.__version__ == "0.8.1", deepspeed.__version__
assert numpy.__version__.startswith("1."), numpy.__version__
assert pydantic.VERSION.startswith("1."), pydantic.VERSION
print(f"deepspeed {deepspeed.__version__}  torch {torch.__version__}  numpy {numpy.__version__}"
      f"  pydantic {pydantic.VERSION}  torch.from_numpy ok: {torch.from_numpy(numpy.ones(2)).sum().item() == 2}")
EOF
