"""The fault campaign's runs one by one, each stamped with the code it ran.

``faults.json`` adds runs up per cell, so a VM lost to a bug fixed since stays
in its cell's count for good, and the table cannot say whether the code of
today still loses it.  Each run is also appended here as one JSON line with
the commit it ran (``git describe``-like, ``+changes`` when the tree differed
from it), so the table can show a cell's runs since any fix apart from the
history.  The log starts with session 18 (2026-11-28); earlier runs exist only
as the per-cell totals.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RUNS_LOG = Path("docs/benchmarks/faults-runs.jsonl")
ERROR_CHARS = 300  # enough to name the failure; the lab's logs hold the rest


def code_version(repo: Path = Path(".")) -> str:
    """The commit the campaign runs, marked when its code differs from it
    (the campaign's own results files do not count as a change)."""
    git = ["git", "-C", str(repo)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not commit:
        return "unknown"
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/benchmarks"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"{commit}+changes" if changed else commit


def entry(cell: str, run: dict[str, Any], seconds: float, code: str, at: str) -> dict[str, Any]:
    """One run's line: what the table counts, and enough to find it again.

    >>> run = {"state": "failed", "hosts": 1, "bad": 0, "lost": 0, "leftovers": [],
    ...        "next_ok": True, "recovered": False, "error": "x" * 400, "libvirt": "9.0.0"}
    >>> line = entry("a/b/c/d", run, 61.04, "abc", "2026-11-28T18:50:00")
    >>> line["vm_lost"], line["seconds"], len(line["error"])
    (False, 61.0, 300)
    """
    return {
        "at": at,
        "cell": cell,
        "code": code,
        "libvirt": run.get("libvirt", ""),
        "transport": run.get("transport"),
        "not_applicable": bool(run.get("not_applicable")),
        "state": run["state"],
        "vm_lost": run["hosts"] != 1,
        "bad": run["bad"],
        "lost": run["lost"],
        "leftovers": len(run["leftovers"]),
        "next_ok": run["next_ok"],
        "recovered": run["recovered"],
        "switch_held": bool(run.get("switch_held")),
        "seconds": round(seconds, 1),
        "error": (run.get("error") or "")[:ERROR_CHARS],
    }


def log_run(cell: str, run: dict[str, Any], seconds: float, code: str,
            path: Path = RUNS_LOG) -> None:  # fmt: skip
    at = datetime.datetime.now(datetime.UTC).isoformat("T", "seconds")
    with path.open("a") as log:
        log.write(json.dumps(entry(cell, run, seconds, code, at), sort_keys=True) + "\n")


def load(path: Path = RUNS_LOG) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()]


def by_cell(lines: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cell: runs (n/a ones apart), VMs lost, bad+lost pages, leftovers,
    failed next migrations, the mean seconds a run took and the commits run.

    >>> rows = by_cell([
    ...     {"cell": "c", "code": "a1", "not_applicable": False, "vm_lost": False, "bad": 0,
    ...      "lost": 0, "leftovers": 0, "next_ok": True, "seconds": 60.0},
    ...     {"cell": "c", "code": "b2", "not_applicable": False, "vm_lost": True, "bad": 0,
    ...      "lost": 2, "leftovers": 1, "next_ok": False, "seconds": 90.0},
    ...     {"cell": "c", "code": "b2", "not_applicable": True, "vm_lost": False, "bad": 0,
    ...      "lost": 0, "leftovers": 0, "next_ok": True, "seconds": 30.0}])
    >>> rows["c"]["runs"], rows["c"]["vm_lost"], rows["c"]["pages"], rows["c"]["next_failed"]
    (2, 1, 2, 1)
    >>> rows["c"]["mean_s"], rows["c"]["codes"], rows["c"]["n/a"]
    (75.0, ['a1', 'b2'], 1)
    """
    rows: dict[str, dict[str, Any]] = {}
    for line in lines:
        row = rows.setdefault(
            line["cell"],
            {"runs": 0, "vm_lost": 0, "pages": 0, "leftovers": 0, "next_failed": 0,
             "seconds": 0.0, "codes": [], "n/a": 0},
        )  # fmt: skip
        if line["code"] not in row["codes"]:
            row["codes"].append(line["code"])
        if line["not_applicable"]:
            row["n/a"] += 1
            continue
        row["runs"] += 1
        row["vm_lost"] += int(line["vm_lost"])
        row["pages"] += line["bad"] + line["lost"]
        row["leftovers"] += int(line["leftovers"] > 0)
        row["next_failed"] += int(not line["next_ok"])
        row["seconds"] += line["seconds"]
    for row in rows.values():
        row["mean_s"] = round(row.pop("seconds") / row["runs"], 1) if row["runs"] else 0.0
    return rows


def render(lines: list[dict[str, Any]]) -> list[str]:
    """The table's section on the logged runs (nothing before the first)."""
    if not lines:
        return []
    rows = by_cell(lines)
    out = [
        f"Runs logged one by one (`{RUNS_LOG}`, from {lines[0]['at'][:10]} on, each with "
        "the commit it ran; the totals above include them):",
        "",
        "| cell | runs | VM lost | bad+lost pages | leftovers | next failed | mean s | n/a "
        "| commits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in sorted(rows):
        row = rows[cell]
        counts = [row[k] for k in ("runs", "vm_lost", "pages", "leftovers", "next_failed")]
        out.append(
            f"| {cell} | " + " | ".join(str(n) for n in counts)
            + f" | {row['mean_s']} | {row['n/a']} | {', '.join(row['codes'])} |"
        )  # fmt: skip
    total_s = sum(line["seconds"] for line in lines)
    out += ["", f"{len(lines)} logged runs, {total_s / 3600:.1f} h of lab time.", ""]
    return out
