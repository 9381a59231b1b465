"""The chart of bench/scaling.py (run with the peers venv, which has matplotlib, as bench/charts.py).

python bench/scaling_chart.py scaling.json OUT_DIR   -> prints the markdown image link
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GUESTD = "#2a7ab0"
FLOOR = "#999999"


def line(ax: Any, xs: list[float], ys: list[float], label: str, floor: bool = False, **kw: Any) -> None:
    ax.plot(
        xs,
        ys,
        marker="o",
        label=label,
        color=kw.pop("color", FLOOR if floor else GUESTD),
        linestyle="--" if floor else "-",
        **kw,
    )


def main() -> None:
    with open(sys.argv[1]) as f:
        res = json.load(f)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), dpi=100)

    ax = axes[0][0]
    pts = res["clients"]["points"]
    xs = [p["clients"] for p in pts]
    line(ax, xs, [p["exec"]["p50_ms"] for p in pts], "exec true p50")
    line(ax, xs, [p["floor_exec"]["p50_ms"] for p in pts], "floor: subprocess.run p50, N threads", floor=True)
    line(ax, xs, [p["ping"]["p99_ms"] for p in pts], "ping p99", color="#d0632a")
    ax.axhline(res["clients"]["idle_echo_p99_ms"], color="#d0632a", linestyle=":", label="floor: idle echo p99")
    ax.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="vs concurrent clients")
    ax.legend(fontsize=7)

    ax = axes[0][1]
    pts = [p for p in res["background"]["points"] if p["processes"] > 0]
    xs = [p["processes"] for p in pts]
    line(ax, xs, [p["exec"]["p50_ms"] for p in pts], "exec true p50")
    line(ax, xs, [p["floor_exec"]["p50_ms"] for p in pts], "floor: subprocess.run p50", floor=True)
    line(ax, xs, [p["ping"]["p99_ms"] for p in pts], "ping p99", color="#d0632a")
    line(ax, xs, [p["echo"]["p99_ms"] for p in pts], "floor: echo p99", floor=True, color="#e8b090")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="live background processes",
        ylabel="ms",
        title="vs live background processes",
    )
    ax.legend(fontsize=7)

    ax = axes[1][0]
    for k in res["memory"]["kinds"]:
        pts_k = k["rss_MiB"]
        line(ax, [max(x, 0.5) for x, _ in pts_k], [y for _, y in pts_k], k["kind"], color=None)
    ax.axhline(res["memory"]["floor_idle_rss_MiB"], color=FLOOR, linestyle="--", label="floor: bare server idle")
    ax.set(xscale="log", xlabel="held (0 drawn at 0.5)", ylabel="guestd RSS, MiB", title="guestd's own RSS vs held")
    ax.legend(fontsize=7)

    ax = axes[1][1]
    pts = res["files"]["points"]
    xs = [p["files"] for p in pts]
    colors = {"glob": "#2a7ab0", "grep": "#d0632a", "download": "#3a9a4a", "watch": "#8a4ab0"}
    for key, color in colors.items():
        line(ax, xs, [p["seconds"][key] * 1000 for p in pts], key, color=color)
        line(
            ax,
            xs,
            [p["seconds"]["floor_" + key] * 1000 for p in pts],
            f"floor of {key}",
            floor=True,
            color=color,
            alpha=0.5,
        )
    ax.set(xscale="log", yscale="log", xlabel="files in the tree", ylabel="ms", title="vs files in the tree")
    ax.legend(fontsize=6, ncol=2)

    fig.suptitle(
        "How guestd's cost grows with the work (bench/scaling.py; when each curve was measured: RESULTS.md)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"))
    plt.close(fig)
    print("![how cost grows with the work](charts/scaling.png)")


if __name__ == "__main__":
    main()
