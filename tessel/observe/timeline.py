"""Pipeline timelines: every rank's forward/backward/send/recv intervals -> Chrome trace and Gantt PNG.

Events are (kind, micro-batch, chunk, start_s, end_s), start and end in seconds
from the rank's step start. The Chrome trace (JSON "traceEvents", complete "X"
events in microseconds, one process row per rank) opens in Perfetto
(ui.perfetto.dev) or chrome://tracing. The Gantt chart draws computes as
coloured bars labelled with their micro-batch, and receive waits as thin grey
bars, so the bubble is the white space.
"""

from __future__ import annotations

import json
from pathlib import Path

Event = tuple[str, int, int, float, float]

NAMES = {"F": "forward", "B": "backward", "W": "weight gradients", "SF": "send act", "SB": "send grad", "RF": "recv act", "RB": "recv grad"}
# forward blue, backward green, weight gradients (a split backward's W) orange, lighter per chunk;
# communication grey
COLORS = {"F": ["#1f77b4", "#6baed6", "#9ecae1", "#c6dbef"], "B": ["#2ca02c", "#74c476", "#a1d99b", "#c7e9c0"],
          "W": ["#ff7f0e", "#fdae6b", "#fdd0a2", "#feedde"]}
COMPUTES = tuple(COLORS)


def bubble_of(events: list[Event]) -> float:
    """Idle share of a rank's step: 1 - compute time / (last compute end)."""
    computes = [(s, e) for k, _, _, s, e in events if k in COMPUTES]
    if not computes:
        return 0.0
    end = max(e for _, e in computes)
    return 1 - sum(e - s for s, e in computes) / end


def chrome_trace(per_rank: list[list[Event]], path: str | Path, name: str = "pipeline step") -> Path:
    trace = []
    for rank, events in enumerate(per_rank):
        trace.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"pp rank {rank}"}})
        for kind, mb, chunk, start, end in events:
            tid = 0 if kind in COMPUTES else 1  # computes and communication on separate rows
            trace.append({"ph": "X", "pid": rank, "tid": tid, "name": f"{kind}{mb}" + (f".{chunk}" if chunk else ""),
                          "cat": NAMES[kind], "ts": start * 1e6, "dur": max(end - start, 1e-7) * 1e6,
                          "args": {"micro_batch": mb, "chunk": chunk}})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"name": name}}))
    return path


def gantt_png(per_rank: list[list[Event]], path: str | Path, title: str = "pipeline step") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = len(per_rank)
    end = max((e for events in per_rank for *_, e in events), default=1.0)
    fig, ax = plt.subplots(figsize=(12, 0.7 * p + 1.4))
    for rank, events in enumerate(per_rank):
        y = p - 1 - rank  # rank 0 on top
        for kind, mb, chunk, start, stop in events:
            if kind in COMPUTES:
                color = COLORS[kind][chunk % len(COLORS[kind])]
                ax.barh(y, (stop - start) * 1e3, left=start * 1e3, height=0.8, color=color, edgecolor="black",
                        linewidth=0.4)
                if (stop - start) > end / 80:
                    ax.text((start + stop) / 2 * 1e3, y, str(mb), ha="center", va="center", fontsize=7)
            elif kind in ("RF", "RB"):
                ax.barh(y - 0.45, (stop - start) * 1e3, left=start * 1e3, height=0.1, color="#999999")
    ax.set_yticks(range(p), [f"rank {p - 1 - r}\nbubble {bubble_of(per_rank[p - 1 - r]):.0%}" for r in range(p)])
    ax.set_xlabel("ms from step start")
    ax.set_title(title, loc="left")
    from matplotlib.patches import Patch
    split = any(kind == "W" for events in per_rank for kind, *_ in events)
    handles = [Patch(color=COLORS["F"][0], label="forward"),
               Patch(color=COLORS["B"][0], label="input gradient (B)" if split else "backward")]
    handles += [Patch(color=COLORS["W"][0], label="weight gradients (W)")] if split else []
    ax.legend(handles=handles + [Patch(color="#999999", label="waiting for a receive")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles) + 1, frameon=False, fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
