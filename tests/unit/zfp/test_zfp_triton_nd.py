"""The 2-D / 3-D Triton ZFP kernels (moeflow.comm.codecs.zfp.triton_nd), run on CPU by Triton's
interpreter, equal the torch back end byte for byte and value for value; and they compile for
an H100 (sm_90), which needs no GPU."""

from __future__ import annotations

import pytest

from tests.helpers.triton_checks import run_check

pytest.importorskip("triton")


@pytest.mark.slow      # 25 s under the interpreter; tests/gpu runs these kernels on a GPU
def test_triton_nd_kernels_match_torch_backend_under_interpreter():
    run_check("zfp_triton_nd_check", "triton nd kernels match")


def test_triton_nd_kernels_compile_for_sm90():
    run_check("zfp_triton_nd_check", "triton nd kernels compile", compile_only=True)
