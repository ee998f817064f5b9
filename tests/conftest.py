"""Tests marked ``gpu`` skip, with the reason, where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

GPU_SKIP_REASON = "needs CUDA (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
