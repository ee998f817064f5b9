"""The fused 8-bit codec kernels (moeflow.comm.codecs.triton_quant), run on CPU by Triton's
interpreter, equal the torch ``fp8``, ``fp8-row`` and ``int8`` codecs bit for bit; and they
compile for an H100 (sm_90) with correctly rounded divisions, no FMA and round-to-nearest-even
casts, which needs no GPU."""

from __future__ import annotations

import pytest

from tests.helpers.triton_checks import run_check

pytest.importorskip("triton")


def test_triton_quant_kernels_match_torch_codecs_under_interpreter():
    run_check("triton_quant_check", "triton quant kernels match")


def test_triton_quant_kernels_compile_for_sm90():
    run_check("triton_quant_check", "triton quant kernels compile", compile_only=True)
