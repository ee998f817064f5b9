"""Validation-loss curves of ``moeflow train`` runs, against steps and against wall-clock time
(the comparison of BigMac Fig. 1), as a table, JSON and optionally a PNG (matplotlib).

Reads each run folder's ``config.json`` and ``metrics.jsonl``; a run is labelled by its
structure (or ``--labels``). ``elapsed_s`` is the training time since the loop started
(validation passes included), as logged by the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_run(folder: str | Path, label: str | None = None) -> dict:
    folder = Path(folder)
    cfg_path, metrics_path = folder / "config.json", folder / "metrics.jsonl"
    if not metrics_path.exists():
        raise FileNotFoundError(f"{metrics_path}: not a moeflow train run folder "
                                "(no metrics.jsonl)")
    config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    points = [(r["step"], r.get("elapsed_s", 0.0), r["val_loss"]) for r in records
              if "val_loss" in r]
    model = config.get("model", {})
    return {"label": label or model.get("structure", folder.name), "folder": str(folder),
            "model": model, "points": points}


def format_table(runs: list[dict]) -> str:
    steps = sorted({p[0] for r in runs for p in r["points"]})
    head = f"{'step':>6} " + " ".join(f"{r['label'] + ' val (s)':>26}" for r in runs)
    lines = [head, "-" * len(head)]
    for s in steps:
        cells = []
        for r in runs:
            hit = [p for p in r["points"] if p[0] == s]
            cells.append(f"{hit[0][2]:>17.3f} ({hit[0][1]:>6.0f})" if hit else f"{'':>26}")
        lines.append(f"{s:>6} " + " ".join(cells))
    lines.append("validation loss in nats/byte; in brackets: seconds since training started")
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for r in runs:
        pts = [p for p in r["points"] if p[0] > 0]
        axes[0].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=r["label"])
        axes[1].plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=r["label"])
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall-clock seconds")
    axes[0].set_ylabel("validation loss (nats/byte)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
