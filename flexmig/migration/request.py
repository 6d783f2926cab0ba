"""One object for everything a migration is asked to do.

The CLI, the agent API and the Nova driver build a ``MigrationRequest``; it is
validated once, here, and carried whole through planning and execution
(instead of six to ten positional parameters).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flexmig import exceptions
from flexmig.policy.decision import REQUESTABLE_MODES
from flexmig.policy.transport import TRANSPORTS

# libvirt's parallel connections (QEMU multifd channels) this product supports.
MAX_PARALLEL = 8
MAX_BANDWIDTH_MIB = 1_000_000
MAX_DOWNTIME_MS = 60_000

_FIELDS: dict[str, type] = {
    "mode": str,
    "max_downtime_ms": int,
    "bandwidth_mib": int,
    "transport": str,
    "parallel": int,
    "store_writeback": bool,
}


@dataclasses.dataclass(frozen=True)
class MigrationRequest:
    """What a caller asks for; ``None`` downtime means the configured budget."""

    vm: str
    mode: str = "auto"
    max_downtime_ms: int | None = None
    bandwidth_mib: int = 0  # a cap on the stream (emulates a slower link); 0: none
    transport: str = "auto"
    parallel: int = 0  # libvirt parallel connections; 1: the single stream; 0: the plan's choice
    store_writeback: bool = True  # write a file-backed VM's memory back as it arrives

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise exceptions.InvalidInput(what="migration request", reason="; ".join(problems))

    def downtime_budget_ms(self, configured_ms: int) -> int:
        """The budget the policy plans for: the request's, else the configured one."""
        return self.max_downtime_ms or configured_ms

    def to_body(self) -> dict[str, Any]:
        """The agent API's JSON form: only what differs from the defaults."""
        default = MigrationRequest(vm=self.vm)
        body: dict[str, Any] = {"vm": self.vm}
        for name in _FIELDS:
            if getattr(self, name) != getattr(default, name):
                body[name] = getattr(self, name)
        return body

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> MigrationRequest:
        """From the agent API's JSON; wrong types are bad input like bad values."""
        kwargs: dict[str, Any] = {}
        for name, kind in _FIELDS.items():
            if name not in body:
                continue
            value = body[name]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise exceptions.InvalidInput(
                    what="migration request", reason=f"field {name!r} has the wrong type"
                )
            kwargs[name] = value
        vm = body.get("vm")
        if not isinstance(vm, str):
            raise exceptions.InvalidInput(what="migration request", reason="'vm' must be a name")
        return cls(vm=vm, **kwargs)


def _problems(req: MigrationRequest) -> list[str]:
    problems = []
    if not req.vm or "/" in req.vm or len(req.vm) > 64:
        problems.append(f"VM name {req.vm!r} is not a plain name")
    if req.mode not in REQUESTABLE_MODES:
        problems.append(f"mode {req.mode!r} is not one of {', '.join(REQUESTABLE_MODES)}")
    if req.max_downtime_ms is not None and not 1 <= req.max_downtime_ms <= MAX_DOWNTIME_MS:
        problems.append(f"max downtime {req.max_downtime_ms} ms not in 1..{MAX_DOWNTIME_MS}")
    if not 0 <= req.bandwidth_mib <= MAX_BANDWIDTH_MIB:
        problems.append(f"bandwidth {req.bandwidth_mib} MiB/s not in 0..{MAX_BANDWIDTH_MIB}")
    if req.transport not in TRANSPORTS:
        problems.append(f"transport {req.transport!r} is not one of {', '.join(TRANSPORTS)}")
    if not 0 <= req.parallel <= MAX_PARALLEL:
        problems.append(f"parallel {req.parallel} not in 0..{MAX_PARALLEL} (0: the plan chooses)")
    # With postcopy the planner keeps parallel connections only where both
    # hosts' QEMU and libvirt carry them together (knobs.choose_parallel).
    return problems
