"""Where the auto-tuner's output goes, and reading its recorded choices back (ScheMoE
section 3.2's profiler + scheduler runs on the cluster, so its choices depend on the machine's
load: recording them is what makes a run repeatable, docs/autotune.md "Reproducible runs").

The tuner (:mod:`moeflow.autotune.tuner`, logger ``moeflow.autotune``, rank 0) logs one INFO
line per tuning (layer, token count, what it chose, how long it took) and its screening,
profiling and measuring detail at DEBUG. Here:

- :func:`log_to_stderr`: the INFO lines on stderr, written above a tqdm progress bar without
  breaking it (``moeflow train``, rank 0);
- :func:`log_to_run_folder`: every line in ``RUN/autotune.log`` and one JSON record per tuning
  in ``RUN/autotune.jsonl`` (``layer_id``, ``tokens``, ``source``, ``choice``: the
  :class:`~moeflow.autotune.tuner.TunedChoice` with every measured candidate);
- :func:`append_record`: a choice that was not measured now (restored, fixed) added to that file;
- :func:`recorded_choices`: the choice in force for each layer id at the end of a run folder's
  ``autotune.jsonl`` (the last record of each layer), for ``moeflow train --tuned-from``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from moeflow.autotune.tuner import TunedChoice, log
from moeflow.errors import ConfigError

DETAIL_FILE = "autotune.log"      # every tuner line, the screening detail included
RECORD_FILE = "autotune.jsonl"    # one JSON record per tuning: layer_id, tokens, choice


class _AboveProgressBar(logging.Handler):
    """Writes a line to stderr through ``tqdm.write``, which clears and redraws an active
    progress bar around it (a plain stream handler would leave the line inside the bar)."""

    moeflow_autotune = True

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        try:
            from tqdm import tqdm
            tqdm.write(self.format(record), file=sys.stderr)
        except ImportError:
            print(self.format(record), file=sys.stderr)


def log_to_stderr() -> None:
    """Show the tuner's one line per tuning on stderr (``moeflow train`` does this on rank 0);
    the screening detail (DEBUG) stays off the screen."""
    if not any(getattr(h, "moeflow_autotune", False) for h in log.handlers):
        handler = _AboveProgressBar(logging.INFO)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)


class _RecordWriter(logging.Handler):
    """Appends the ``tuned`` payload of the tuner's per-tuning records as JSON lines."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        tuned = getattr(record, "tuned", None)
        if tuned is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(tuned) + "\n")


@contextlib.contextmanager
def log_to_run_folder(out_dir: str | Path, enabled: bool = True):
    """While inside: every tuner line (detail included) appended to ``out_dir/autotune.log``
    and each tuning's record to ``out_dir/autotune.jsonl`` (``enabled``: False on ranks other
    than 0, which log nothing). The logger's level and handlers are restored on exit."""
    if not enabled:
        yield
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = logging.FileHandler(out / DETAIL_FILE, delay=True)   # created when written
    text.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    records = _RecordWriter(out / RECORD_FILE)
    level = log.level
    log.addHandler(text)
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.removeHandler(text)
        log.removeHandler(records)
        text.close()
        log.setLevel(level)


def append_record(out_dir: str | Path, layer_id: int | None, choice: TunedChoice,
                  source: str) -> None:
    """Add a choice the tuner did not measure now (``source``: where it came from, e.g. a
    checkpoint or ``--tuned-from``) to ``out_dir/autotune.jsonl``, so the file always ends
    with the choices in force (rank 0's job)."""
    with open(Path(out_dir) / RECORD_FILE, "a") as f:
        f.write(json.dumps({"layer_id": layer_id, "tokens": None, "source": source,
                            "choice": choice.as_dict()}) + "\n")


def recorded_choices(run_dir: str | Path, flag: str = "--tuned-from") -> dict[int, TunedChoice]:
    """The choice in force at the end of ``run_dir`` for each layer id: the last record of each
    layer in its ``autotune.jsonl`` (a re-tuning replaces the earlier choice). ``ConfigError``
    (naming ``flag``) when the folder has no such file or it holds no record."""
    path = Path(run_dir) / RECORD_FILE
    if not path.exists():
        raise ConfigError(f"{flag} {run_dir}: no {RECORD_FILE} there; give the folder of a "
                          f"'moeflow train' run whose MoE layers were auto-tuned (its --out)")
    found: dict[int, TunedChoice] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            found[int(rec["layer_id"])] = TunedChoice.from_dict(rec["choice"])
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{flag} {run_dir}: line {n} of {RECORD_FILE} is not a tuning "
                              f"record ({err}); the file is written by 'moeflow train'")
    if not found:
        raise ConfigError(f"{flag} {run_dir}: {RECORD_FILE} holds no tuning record")
    return found
