"""The Targets rows that other benches measure, run inside ``python -m bench.run`` so every goal
has a verdict against a floor from the same run: a relay connect (bench/relay.py's rig), tree
upload and download against tar (bench/trees.py, the system's temp directory), the warm code
pool under a burst of creates (bench/code_pool.py, the shipped pool size), and exec's p99
against qemu-ga's (bench/peers.py, measured by bench.run itself).

Each is a shorter run than its own bench's (fewer rounds): the full tables stay in RELAY.md,
TREES.md and code_pool.py's docstring."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

RELAY_CONNECT_GOAL = 3.0  # a relay connect within 3x of a plain loopback connect
TREE_GOAL = 0.5  # at least half of tar | socket | tar, both ways
EXEC_P99_VS_QGA_GOAL = 1.5  # exec p99 within 1.5x of qemu-ga's (the C agent) p99
SHIPPED_POOL, POOL_BURST = 1, 3  # rootfs-overlay's guestd.toml keeps one kernel warm


async def measure_more(quick: bool) -> dict[str, Any]:
    """Relay connect, trees and the code pool; a part that fails is left out and said on stderr."""
    from bench import code_pool, relay, trees

    out: dict[str, Any] = {}
    try:
        out["relay_connect"] = await relay.connect_figures(quick)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"relay connect left out: {exc!r}", file=sys.stderr)
    try:
        out["trees"] = await asyncio.to_thread(trees.tree_figures, None, 2 if quick else 3)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"trees left out: {exc!r}", file=sys.stderr)
    try:
        pool = await code_pool.measure(3 if quick else 6, SHIPPED_POOL, POOL_BURST, [("this checkout", None)])
        out["code_pool"] = {"cold_create": pool["cold_create"], **pool["variants"]["this checkout"]}
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"code pool left out: {exc!r}", file=sys.stderr)
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def more_target_rows(res: dict[str, Any]) -> list[str]:
    """Targets rows of :func:`measure_more`'s figures (``res["more"]``) and of exec p99 against
    qemu-ga's (``res["peers"]``)."""
    rows: list[str] = []
    qga = res.get("peers", {}).get("qemu-ga")
    g = res["guestd"]
    if qga is not None:
        qga_p99 = qga["exec_true"]["p99_ms"]
        shipped = g.get("shipped", {}).get("exec_true")
        for label, e in (("root, no workload settings", g["exec_true"]), ("shipped config", shipped)):
            if e is None:
                continue
            ratio = e["p99_ms"] / qga_p99
            rows.append(
                f"| exec `true` p99, {label} | {e['p99_ms']:.2f} ms (n {e['n']}) | {qga_p99:.2f} ms "
                f"(qemu-ga p99, n {qga['exec_true']['n']}) | {ratio:.2f}x | <= {EXEC_P99_VS_QGA_GOAL}x "
                f"| {_verdict(ratio <= EXEC_P99_VS_QGA_GOAL)} |"
            )
    more = res.get("more", {})
    cn = more.get("relay_connect")
    if cn is not None:
        ratio = cn["relay_p50_ms"] / cn["direct_p50_ms"]
        rows.append(
            f"| port relay connect p50 | {cn['relay_p50_ms']:.3f} ms | {cn['direct_p50_ms']:.3f} ms "
            f"(plain loopback connect) | {ratio:.1f}x | <= {RELAY_CONNECT_GOAL:g}x "
            f"| {_verdict(ratio <= RELAY_CONNECT_GOAL)} |"
        )
    for t in more.get("trees", []):
        floor = "`tar -c | unix socket | tar -x`" if t["label"] == "tree upload" else "`tar -c | unix socket | cat`"
        rows.append(
            f"| {t['label']} ({t['files']:,} entries, {t['bytes'] / 1e6:.0f} MB, {t['fs']}) "
            f"| {t['guestd_s']:.2f} s | {t['floor_s']:.2f} s ({floor}) | {t['ratio']:.0%} of the floor's speed "
            f"(rounds {t['ratio_min']:.0%}-{t['ratio_max']:.0%}) | >= {TREE_GOAL:.0%} "
            f"| {_verdict(t['ratio'] >= TREE_GOAL)} |"
        )
    pool = more.get("code_pool")
    if pool is not None:
        cold = pool["cold_create"]["p50_ms"]
        burst = pool["burst_create"]["p50_ms"]
        refill = pool["refill_p50_s"]
        refill_text = "not full again in time" if refill is None else f"full again {refill * 1000:.0f} ms after"
        rows.append(
            f"| code create in a burst of {POOL_BURST}, pool of {SHIPPED_POOL} (shipped), p50 | {burst:.0f} ms "
            f"({pool['pooled_per_burst']:g} of {POOL_BURST} from the pool; {refill_text}) | {cold:.0f} ms (cold "
            f"create, same rounds) | {burst / cold:.2f}x | (context: the pool hides one start per burst) | - |"
        )
    return rows
