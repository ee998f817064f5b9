"""Timelines of scheduled tasks as a Chrome trace (chrome://tracing, Perfetto) and as a PNG
Gantt chart in the style of ScheMoE's Fig. 5 (computing lane and communication lane)."""

from __future__ import annotations

import json

from moeflow.schedule.executor import TaskRecord

LANES = {"compute": 0, "comm": 1}


def chrome_trace(records: list[TaskRecord], path: str, rank: int = 0) -> None:
    """Write ``records`` as Chrome trace events (microseconds from the first record)."""
    if not records:
        raise ValueError("the timeline is empty: run the layer with layer.timeline set first")
    t0 = min(r.start for r in records)
    events = [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
               "args": {"name": f"{lane} lane"}} for lane, tid in LANES.items()]
    for r in records:
        events.append({"name": str(r.task), "cat": r.phase, "ph": "X", "pid": rank,
                       "tid": LANES[r.lane], "ts": (r.start - t0) * 1e6,
                       "dur": (r.end - r.start) * 1e6, "args": {"size": r.size}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def gantt_png(records: list[TaskRecord], path: str, title: str = "") -> None:
    """Draw the forward and backward passes as two-lane Gantt charts (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:      # pragma: no cover - depends on the environment
        raise RuntimeError("PNG timelines need matplotlib: pip install 'moeflow[plot]'") from err
    if not records:
        raise ValueError("the timeline is empty: run the layer with layer.timeline set first")
    colors = {"C": "#4c72b0", "A": "#dd8452", "D": "#55a868", "E": "#c44e52", "S": "#8172b3"}
    phases = [p for p in ("forward", "backward") if any(r.phase == p for r in records)]
    fig, axes = plt.subplots(len(phases), 1, figsize=(11, 1.6 + 1.3 * len(phases)),
                             squeeze=False)
    for ax, phase in zip(axes[:, 0], phases):
        recs = [r for r in records if r.phase == phase]
        t0 = min(r.start for r in recs)
        for r in recs:
            y = LANES[r.lane]
            ax.barh(y, (r.end - r.start) * 1e3, left=(r.start - t0) * 1e3, height=0.6,
                    color=colors[r.task.kind[0]], edgecolor="black", linewidth=0.5)
            ax.text((r.start - t0 + (r.end - r.start) / 2) * 1e3, y, str(r.task),
                    ha="center", va="center", fontsize=7)
        ax.set_yticks([0, 1], ["compute", "comm"])
        ax.set_title(f"{title} {phase}".strip(), fontsize=9)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
