"""Charts of the headline comparisons (run with the peers venv, which has matplotlib).

python bench/charts.py results.json OUT_DIR   -> prints markdown image links
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MiB = 1024 * 1024


def bars(path: str, title: str, unit: str, values: dict[str, float], lower_is_better: bool) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=110)
    names = list(values)
    colors = ["#2a7ab0" if n == "guestd" else "#999999" for n in names]
    ax.barh(names, [values[n] for n in names], color=colors)
    for i, n in enumerate(names):
        ax.text(values[n], i, f" {values[n]:.3g}", va="center", fontsize=8)
    ax.set_title(f"{title} ({'lower' if lower_is_better else 'higher'} is better)", fontsize=10)
    ax.set_xlabel(unit)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    with open(sys.argv[1]) as f:
        res = json.load(f)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    g, fl, peers = res["guestd"], res["floor"], res.get("peers", {})
    charts = []

    def add(name: str, title: str, unit: str, vals: dict[str, float], low: bool) -> None:
        bars(os.path.join(out, name), title, unit, vals, low)
        charts.append((title, name))

    add(
        "exec_true.png",
        "exec `true`, p50",
        "ms",
        {
            "guestd": g["exec_true"]["p50_ms"],
            **{k: v["exec_true"]["p50_ms"] for k, v in peers.items()},
            "floor: subprocess.run": fl["subprocess_true"]["p50_ms"],
        },
        True,
    )
    add(
        "ping.png",
        "no-op round trip, p50",
        "ms",
        {
            "guestd": g["ping"]["p50_ms"],
            **{k: v["ping"]["p50_ms"] for k, v in peers.items()},
            "floor: msgpack echo": fl["echo_ping"]["p50_ms"],
        },
        True,
    )
    f64 = str(64 * MiB)
    add(
        "files_64mib.png",
        "64 MiB write + read, mean of both",
        "MB/s",
        {
            "guestd": (g["files"][f64]["upload_MBps"] + g["files"][f64]["download_MBps"]) / 2,
            **{k: (v["files"][f64]["write_MBps"] + v["files"][f64]["read_MBps"]) / 2 for k, v in peers.items()},
        },
        False,
    )
    add(
        "idle_rss.png",
        "idle RSS",
        "MiB",
        {"guestd": g["idle_rss_MiB"], **{k: v["idle_rss_MiB"] for k, v in peers.items()}},
        True,
    )
    for title, name in charts:
        print(f"![{title}](charts/{name})")


if __name__ == "__main__":
    main()
