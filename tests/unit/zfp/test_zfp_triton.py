"""The Triton ZFP kernels, run on CPU by Triton's interpreter, equal the torch back end; and they
compile for an H100 (sm_90), which needs no GPU."""

from __future__ import annotations

import pytest

from tests.helpers.triton_checks import run_check

pytest.importorskip("triton")


def test_triton_kernels_match_torch_backend_under_interpreter():
    run_check("zfp_triton_check", "triton kernels match")


def test_triton_kernels_compile_for_sm90():
    run_check("zfp_triton_check", "triton kernels compile", compile_only=True)
