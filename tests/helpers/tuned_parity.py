"""What "tuning changes speed only" means in numbers, for the multi-rank tuner tests
(tests/multirank/test_autotune.py, tests/multirank/test_autotune_lossy.py); ScheMoE section 4
cuts the exchange into r chunks, which is the one tuned setting that moves the numbers.

An auto-tuned layer's first step is compared twice:

1. with a fresh layer built with the settings the tuner chose, **bit for bit**: the tuning
   leaves nothing behind (no codec, algorithm, schedule or field of a screened candidate),
   whatever it screened and wherever its time budget cut it;
2. with the untuned layer (``direct`` / ``sequential`` / r = 1, codec ``none``): outputs and
   input gradients to float64 round-off, the weight gradients to a bound set by the chosen r.

Why the bound: the layer's parameters are float32 (``moeflow.init`` draws them in float32;
``torch.set_default_dtype(torch.float64)`` does not change that), so with float64 inputs the
experts compute in float64 but every weight gradient is a float32 sum: at r chunks it is the
sum of r float32 partial gradients, rounded in another order than the one product at r = 1.
Measured on the workers' float64 data (every algorithm, schedule and r in {1, 2, 4}, both
ranks): identical at r = 1; at r = 2 and 4 up to 3.7e-9 - 3.0e-8 absolute on gradients whose
largest element is 0.07 - 0.32, i.e. at most 0.8 float32 ulp-at-the-maximum, within the bound
``r * eps(float32) * max|gradient|`` used here by at least 2x. The tuner picks r by timing (a
loaded machine can make r = 2 look fastest), so comparing with r = 1 bit for bit fails
depending on load; comparing with the chosen settings does not.
"""

from __future__ import annotations

import torch


def assert_tuned_step(got: dict, chosen: dict, plain: dict, r: int, what: str) -> None:
    """``got``: the tuned layer's first step (output ``y``, input gradient ``dx``, then each
    parameter's gradient by name); ``chosen``: the same step of a layer built with the chosen
    settings; ``plain``: of the untuned layer; ``r``: the chosen pipelining degree."""
    assert got.keys() == chosen.keys() == plain.keys()
    for k in chosen:
        torch.testing.assert_close(got[k], chosen[k], rtol=0, atol=0,
                                   msg=lambda m: f"{what} {k} against the chosen settings "
                                                 f"(r={r}): {m}")
    for k in plain:
        if k in ("y", "dx"):           # float64 computation: chunks only reorder rows
            tol = dict(rtol=1e-12, atol=1e-12)
        else:                          # a gradient of a float32 parameter: r float32 partials
            scale = float(plain[k].abs().max())
            tol = dict(rtol=0.0, atol=r * torch.finfo(plain[k].dtype).eps * scale
                       if r > 1 else 0.0)
        torch.testing.assert_close(got[k], plain[k], **tol,
                                   msg=lambda m: f"{what} {k} against direct / sequential / "
                                                 f"r=1 (chosen r={r}): {m}")
