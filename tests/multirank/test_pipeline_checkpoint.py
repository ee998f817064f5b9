"""Checkpoints of ``moeflow train --pp`` across pipeline layouts: PP 2 -> PP 2 resumes bit for
bit, PP 2 -> PP 1 -> PP 2 continues the same run to round-off
(tests/helpers/pipeline_resume_cases.py)."""

from __future__ import annotations

import pytest

from moeflow.launch import launch_local
from tests.helpers import pipeline_resume_cases as cases


@pytest.mark.multirank
@pytest.mark.slow
def test_checkpoints_load_across_pipeline_layouts(tmp_path):
    root = str(tmp_path)
    first = launch_local(cases.straight_and_resumed, 4, root, timeout_s=300)[0]
    straight = first["straight"]
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    # the same layout: the resumed run logs the straight run's losses bit for bit
    assert first["resumed"] == {s: straight[s] for s in (3, 4, 5, 6)}
    cases.copy_run(f"{root}/straight", f"{root}/pp1", 2)
    # --steps 6 as the straight run (the learning-rate schedule spans --steps)
    pp1 = launch_local(cases.resume, 2, f"{root}/pp1", 1, 6, timeout_s=300)[0]
    assert sorted(pp1) == [3, 4, 5, 6]
    cases.copy_run(f"{root}/pp1", f"{root}/pp2", 4)
    pp2 = launch_local(cases.resume, 4, f"{root}/pp2", 2, 6, timeout_s=300)[0]
    assert sorted(pp2) == [5, 6]
    for run in (pp1, pp2):                  # another layout: the same run to round-off
        for step, loss in run.items():
            assert loss == pytest.approx(straight[step], rel=1e-5), step
