"""Auto-tuning of a layer's all-to-all algorithm, schedule, pipelining degree, (opt-in)
lossy codec and (``placement="auto"``) strategy, measured on the running cluster (ScheMoE
sections 3.2 and 4; docs/autotune.md).

Modules, each importing only those listed before it (no import circle):

- :mod:`moeflow.autotune.clock`: the time budget (``MoEConfig.autotune_budget_s``);
- :mod:`moeflow.autotune.paired`: the placement screen's interleaved (EP, node_dedup) pairs
  and its median-of-pairs decision;
- :mod:`moeflow.autotune.settings`: applying a candidate setting to a layer, and restoring what
  tuning must not change;
- :mod:`moeflow.autotune.lossy`: the measured error of each lossy codec
  (``codec="auto:lossy"``);
- :mod:`moeflow.autotune.tuner`: the tuner itself (:func:`tune`, :func:`pick`, re-tuning,
  tuning state in checkpoints);
- :mod:`moeflow.autotune.runlog`: where its lines go (one per tuning on stderr, the detail
  and a record per tuning in the run folder) and reading recorded choices back.

Timings come from the measurement core (:mod:`moeflow.measure.timing`). The names below are
the package's interface (``from moeflow import autotune; autotune.tune(...)``).
"""

from moeflow.autotune.clock import TuneClock
from moeflow.autotune.paired import PAIRED_REPS, dedup_wins
from moeflow.measure.timing import paired_times
from moeflow.autotune.lossy import ErrorProbe, codec_errors, gentlest_first, lossy_candidates
from moeflow.autotune.settings import _Preserved, apply
from moeflow.autotune.tuner import AUTO_FIELDS, \
    DEDUP_ROUTE, DEGREES, KEEP_ALGOS, MEASURE_TOP, RETUNE_CHECK_EVERY, RETUNE_RATIO, \
    SCHEDULES, SIMPLER_MARGIN, TunedChoice, \
    auto_fields, candidate_algorithms, concrete, layout, log, \
    needs_retune, overlap_trials, pick, placeholder, placement_candidates, restore_tuning, \
    retune_agreed, screen_order, tune, tuning_state
from moeflow.autotune.runlog import DETAIL_FILE, RECORD_FILE, append_record, \
    log_to_run_folder, log_to_stderr, recorded_choices

__all__ = ["AUTO_FIELDS", "DEDUP_ROUTE", "DEGREES",
           "DETAIL_FILE", "ErrorProbe", "KEEP_ALGOS", "MEASURE_TOP", "PAIRED_REPS", "RECORD_FILE",
           "RETUNE_CHECK_EVERY", "RETUNE_RATIO", "SCHEDULES", "SIMPLER_MARGIN",
           "TuneClock", "TunedChoice", "append_record", "apply", "auto_fields",
           "candidate_algorithms", "codec_errors", "concrete", "dedup_wins",
           "gentlest_first", "layout", "log", "log_to_run_folder", "log_to_stderr",
           "lossy_candidates", "needs_retune", "overlap_trials", "paired_times", "pick", "placeholder",
           "placement_candidates",
           "recorded_choices", "restore_tuning", "retune_agreed", "screen_order",
           "tune", "tuning_state"]
