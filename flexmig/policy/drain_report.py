"""A drain's outcome against its plan: what happened to each VM, as a table.

Apart from the planner (``flexmig.policy.drain``) because it reads a drain
that ran; pure, like the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flexmig.policy.drain import DrainPlan


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened to one VM of a drain."""

    vm: str
    state: str  # completed | failed | skipped | unplaceable
    start_s: float | None = None
    end_s: float | None = None
    mode: str | None = None
    dest: str | None = None
    note: str = ""


def compare(plan_: DrainPlan, outcomes: Sequence[Outcome], measured_total_s: float) -> str:
    """Predicted against measured, per VM and in total, as a table.

    >>> from flexmig.policy.dirty_model import DirtyModel
    >>> from flexmig.policy.drain import MIB, Candidate, DrainVM, Fabric, plan
    >>> vms = [DrainVM.sized("a", 256 * MIB, 64 * MIB, DirtyModel(0, 1), True)]
    >>> p = plan("A", vms, [Candidate("B", 2048 * MIB, 0)], Fabric(100 * MIB, 100 * MIB))
    >>> print(compare(p, [Outcome("a", "completed", 0.0, 1.2, "precopy", "B")], 1.3))
    VM    dest  mode      state       predicted s  measured s
    a     B     precopy   completed           1.2         1.2
    total                                     1.2         1.3  (measured/predicted 1.09)
    """
    predicted = {m.vm: m for m in plan_.moves}
    rows = [
        f"{'VM':<5} {'dest':<5} {'mode':<9} {'state':<11} {'predicted s':>11} {'measured s':>11}"
    ]
    for out in outcomes:
        move = predicted.get(out.vm)
        pred = f"{move.end_s - move.start_s:.1f}" if move else "-"
        took = (
            f"{out.end_s - out.start_s:.1f}"
            if out.end_s is not None and out.start_s is not None
            else "-"
        )
        mode = out.mode or (move.mode if move else "-")
        dest = out.dest or (move.dest if move else "-")
        rows.append(f"{out.vm:<5} {dest:<5} {mode:<9} {out.state:<11} {pred:>11} {took:>11}")
    ratio = measured_total_s / plan_.total_s if plan_.total_s > 0 else float("nan")
    rows.append(
        f"{'total':<33} {plan_.total_s:>11.1f} {measured_total_s:>11.1f}  "
        f"(measured/predicted {ratio:.2f})"
    )
    return "\n".join(rows)
