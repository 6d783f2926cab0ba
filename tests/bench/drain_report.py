"""The drain benchmark's tables, from its results. Pure (no lab), so it is unit-tested.

``results``: strategy -> what ``bench_drain.one_strategy`` measured:
total_s, outcomes (VM -> "moved" or why not), moved, bad, lost,
downtime_ms (VM -> (longest gap, switchover gap)), budgets (VM -> ms) and,
for FlexMig, its plan's figures; for Nova's ways held_s (VM -> s).
"""

from __future__ import annotations

from typing import Any

DRAINS = ("nova-serial", "fixed-2", "fixed-4", "flexmig", "flexmig-1")


def ratios(results: dict[str, Any]) -> dict[str, str]:
    """FlexMig's total against Nova's default and against the best fixed concurrency.

    >>> r = {"nova-serial": {"total_s": 200.0}, "fixed-2": {"total_s": 120.0},
    ...      "fixed-4": {"total_s": 110.0}, "flexmig": {"total_s": 44.0}}
    >>> ratios(r)
    {'vs nova-serial': '0.22', 'vs best fixed (fixed-4)': '0.40'}
    >>> ratios({"flexmig": {"total_s": 44.0}})
    {}
    """
    if "flexmig" not in results:
        return {}
    fm = results["flexmig"]["total_s"]
    out = {}
    if "nova-serial" in results:
        out["vs nova-serial"] = f"{fm / results['nova-serial']['total_s']:.2f}"
    fixed = [s for s in ("fixed-2", "fixed-4") if s in results]
    if fixed:
        best = min(fixed, key=lambda s: results[s]["total_s"])
        out[f"vs best fixed ({best})"] = f"{fm / results[best]['total_s']:.2f}"
    return out


def not_moved(result: dict[str, Any]) -> str:
    """Why each VM that did not move stayed, with how long it held the drain.

    >>> not_moved({"outcomes": {"a": "moved", "b": "NoValidHost", "c": "aborted: x"},
    ...            "held_s": {"c": 100.6}})
    'b: NoValidHost; c: aborted: x (held the drain 100.6 s)'
    """
    parts = []
    for name, outcome in result["outcomes"].items():
        if outcome == "moved":
            continue
        held = result.get("held_s", {}).get(name)
        parts.append(f"{name}: {outcome}" + (f" (held the drain {held} s)" if held else ""))
    return "; ".join(parts)


def over_budget(result: dict[str, Any]) -> list[str]:
    """The moved guests whose longest gap went over their budget.

    >>> over_budget({"downtime_ms": {"a": (420.0, 90.0), "b": (120.0, 80.0)},
    ...              "budgets": {"a": 300, "b": 300}})
    ['a 420/300 ms']
    """
    budgets = result["budgets"]
    return [
        f"{name} {gap:.0f}/{budgets[name]} ms"
        for name, (gap, _) in result["downtime_ms"].items()
        if name in budgets and gap > budgets[name]
    ]


def summary_rows(results: dict[str, Any], guests: int) -> list[str]:
    base = results.get("nova-serial", {}).get("total_s")
    rows = []
    for s in (d for d in DRAINS if d in results):
        r = results[s]
        failed = sum(1 for o in r["outcomes"].values() if o != "moved")
        ratio = f"{r['total_s'] / base:.2f}" if base else "-"
        gaps = [g for g, _ in r["downtime_ms"].values()]
        worst = f"{max(gaps):.0f}" if gaps else "-"
        rows.append(
            f"| {s} | {r['total_s']:.1f} | {ratio} | {r['moved']}/{guests} | {failed} | "
            f"{r['bad']} | {r['lost']} | {worst} | {'; '.join(over_budget(r)) or 'none'} | "
            f"{not_moved(r)} |"
        )
    return rows


def per_vm_rows(results: dict[str, Any], names: list[str]) -> list[str]:
    """Per VM: the machine's own gap (noise), FlexMig's budget, each strategy's gaps
    (FlexMig's with its plan's forecast, CPU contention included).

    >>> r = {"noise": {"downtime_ms": {"a": (380.0, 0.0)}},
    ...      "flexmig": {"downtime_ms": {"a": (450.0, 120.0)}, "budgets": {"a": 300},
    ...                  "forecast_ms": {"a": 400.0}}}
    >>> per_vm_rows(r, ["a"])
    ['| a | 380 | 300 | 450 / 120 (fc 400) | - | - | - | - |']
    """
    rows = []
    for name in names:
        cells = [name]
        cells.append(_ms(results.get("noise", {}).get("downtime_ms", {}).get(name, (None,))[0]))
        cells.append(str(results.get("flexmig", {}).get("budgets", {}).get(name, "-")))
        for s in ("flexmig", "flexmig-1", "nova-serial", "fixed-2", "fixed-4"):
            gap = results.get(s, {}).get("downtime_ms", {}).get(name)
            forecast = results.get(s, {}).get("forecast_ms", {}).get(name)
            cell = f"{gap[0]:.0f} / {gap[1]:.0f}" if gap else "-"
            cells.append(cell + (f" (fc {forecast:.0f})" if gap and forecast else ""))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(results: dict[str, Any], names: list[str], header: list[str]) -> str:
    lines = [
        *header,
        "",
        "| strategy | total s | vs nova-serial | moved off A | not moved | bad | lost "
        "| worst gap ms | over budget (gap/budget) | not moved, why |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *summary_rows(results, len(names)),
        "",
    ]
    if ratios(results):
        lines += [
            "FlexMig's total: " + ", ".join(f"{k} {v}x" for k, v in ratios(results).items()) + ".",
            "",
        ]
    lines += [
        "Per VM, guest-observed (ms): the longest heartbeat gap during the strategy / the "
        "longest gap across its change of host (its switchover). noise: the same guests on A "
        "with no migration for the noise window, the machine's own gaps. Budget: FlexMig's "
        "plan budget (the agents' [migration] max_downtime_ms); Nova's ways aim at their "
        "live_migration_downtime, 500 ms. fc: FlexMig's plan's forecast, CPU contention "
        "included.",
        "",
        "| VM | noise | budget | flexmig | flexmig-1 | nova-serial | fixed-2 | fixed-4 |",
        "|---|---|---|---|---|---|---|---|",
        *per_vm_rows(results, names),
        "",
    ]
    for s in (x for x in ("noise", *DRAINS) if x in results and "hold" in results[x]):
        lines.append(f"- {s}: lab hold {results[s]['hold']}")
    fm = results.get("flexmig")
    if fm:
        lines += [
            "",
            f"FlexMig: {fm['concurrency']} at once; facts gathered and planned in "
            f"{fm['gather_s']:.1f} s, then executed in {fm['executed_s']:.1f} s against "
            f"{fm['predicted_s']:.1f} s predicted (measured/predicted "
            f"{fm['executed_s'] / fm['predicted_s']:.2f}).",
            "",
            "```",
            fm["plan"],
            "",
            fm["table"],
            "```",
        ]
    return "\n".join(lines) + "\n"
