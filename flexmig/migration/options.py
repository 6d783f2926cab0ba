"""The ``[migration]`` options: one definition, read by nova-compute and the agent.

They used to live twice, as ``[agent]`` options of the agent and ``[flexmig]``
options of nova.conf, with different defaults (``stall_timeout`` 15 s vs 60 s).
The old names stay readable as deprecated aliases, since operators may have
set them.
"""

from __future__ import annotations

import dataclasses
import math

from oslo_config import cfg, types

from flexmig import exceptions
from flexmig.migration.request import MAX_DOWNTIME_MS
from flexmig.policy.decision import MODES
from flexmig.policy.transport import TRANSPORTS

GROUP = "migration"


def _was(name: str, *groups: str) -> list[cfg.DeprecatedOpt]:
    return [cfg.DeprecatedOpt(name, group=group) for group in groups]


migration_opts = [
    cfg.IntOpt(
        "max_downtime_ms",
        default=300,
        min=1,
        max=MAX_DOWNTIME_MS,
        deprecated_opts=_was("max_downtime_ms", "agent", "flexmig"),
        help="Downtime budget (ms) the policy plans migrations for. On the Nova "
        "path it replaces [libvirt] live_migration_downtime.",
    ),
    cfg.ListOpt(
        "allowed_modes",
        item_type=types.String(choices=MODES),
        default=list(MODES),
        deprecated_opts=_was("allowed_modes", "flexmig"),
        help="Modes the policy may choose. Without postcopy a non-converging "
        "precopy is throttled (auto-converge); without split a destination "
        "short of RAM is refused.",
    ),
    cfg.ListOpt(
        "dirty_sample_seconds",
        item_type=types.Integer(min=1, max=30),
        default=[1, 2, 3],
        deprecated_opts=_was("dirty_sample_seconds", "agent", "flexmig"),
        help="Lengths (s) of the dirty-rate samples (libvirt domdirtyrate-calc) "
        "the dirty-page model is fitted to before each migration; at least two "
        "distinct values. Their sum delays the start of every migration. Samples "
        "much shorter than the time a guest takes to rewrite its set cannot tell a "
        "small rewritten set from a large one (libvirt's page-sampled rates are "
        "noisy), which split's forecast of faults on the store depends on: longer "
        "ones (e.g. 1,5,15) make it steadier, at the cost of the delay.",
    ),
    cfg.IntOpt(
        "stream_bandwidth_mib",
        default=256,
        min=1,
        max=1_000_000,
        deprecated_opts=[
            cfg.DeprecatedOpt("initial_stream_bandwidth_mib", group="agent"),
            cfg.DeprecatedOpt("stream_bandwidth_mib", group="flexmig"),
        ],
        help="Migration stream bandwidth (MiB/s) assumed towards a destination "
        "until a migration to it has been measured; capped by the fabric's "
        "probed rate and by any bandwidth limit of the migration.",
    ),
    cfg.IntOpt(
        "bandwidth_probe_mib",
        default=64,
        min=0,
        max=256,
        deprecated_opts=_was("bandwidth_probe_mib", "flexmig"),
        help="MiB pulled from the destination agent to measure the fabric before "
        "planning; 0 skips the probe and trusts stream_bandwidth_mib.",
    ),
    cfg.FloatOpt(
        "stall_timeout",
        default=15.0,
        min=1.0,
        max=3600.0,
        deprecated_opts=_was("stall_timeout", "agent", "flexmig"),
        help="Seconds without migration progress before a precopy is aborted "
        "(the VM keeps running on the source) or, on the agent path, a "
        "postcopy is paused for recovery.",
    ),
    cfg.FloatOpt(
        "setup_timeout",
        default=60.0,
        min=1.0,
        max=3600.0,
        help="Seconds a migration may take before its first page moves (libvirt "
        "starts the destination QEMU first, seconds on a busy host) before it "
        "counts as stalled and is aborted; after that, stall_timeout applies.",
    ),
    cfg.FloatOpt(
        "converge_timeout",
        default=30.0,
        min=1.0,
        max=3600.0,
        help="Seconds a precopy may stay behind (its plan's rounds past, its "
        "remainder too large for the downtime limit, e.g. a stream no faster "
        "than the guest dirties memory, as a split destination faulting pages "
        "back from its store) after the in-flight correction engaged, before "
        "the guest is paused so the rest moves while it is stopped (seed 000's "
        "stop-and-copy; the downtime then exceeds the budget, and the log says "
        "by how much). On the Nova path this replaces Nova's completion timeout.",
    ),
    cfg.FloatOpt(
        "recovery_timeout",
        default=300.0,
        min=5.0,
        max=86400.0,
        deprecated_opts=_was("recovery_timeout", "agent"),
        help="Seconds a broken postcopy keeps trying to resume (agent path).",
    ),
    cfg.StrOpt(
        "postcopy_without_recovery",
        default="warn",
        choices=[
            ("warn", "postcopy stays a choice; the plan and the migration's events warn"),
            ("refuse", "no postcopy there: precopy (auto-converge) or split instead"),
        ],
        help="Postcopy between hosts whose libvirt cannot resume a postcopy whose "
        "connection broke (flexmig explain's postcopy-recovery: libvirt older than "
        "11.0 with QEMU 9.1 or later, or older than 8.5): a link failure after the "
        "switch leaves such a VM paused on both hosts until libvirtd on the source "
        "is restarted and the migration resumed by hand.",
    ),
    cfg.StrOpt(
        "tcp_fabric_transport",
        default="qemu-tcp",
        choices=[t for t in TRANSPORTS if t != "auto"],
        deprecated_opts=_was("tcp_fabric_transport", "agent"),
        help="Transport for migrations where the fabric has no RDMA provider: what "
        "docs/benchmarks/mover.md measured faster on TCP. Where both ends have "
        "verbs;ofi_rxm the mover is used.",
    ),
    cfg.StrOpt(
        "transport",
        default="auto",
        choices=list(TRANSPORTS),
        help="Transport of migrations started by Nova: qemu-tcp (QEMU's own "
        "stream), mover (the agents' data movers, one pair per connection of "
        "Nova's [libvirt] live_migration_parallel_connections) or auto (the "
        "mover where the fabric has RDMA, else tcp_fabric_transport). Agent API "
        "requests name their own.",
    ),
]


class InvalidConfig(exceptions.InvalidInput):
    msg_fmt = "Invalid [%(group)s] %(option)s: %(reason)s"


def register_opts(conf: cfg.ConfigOpts) -> None:
    conf.register_opts(migration_opts, group=GROUP)


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator (entry point ``flexmig.migration``)."""
    return [(GROUP, migration_opts)]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The options as plain values, what the pure planner is fed."""

    max_downtime_ms: int = 300
    allowed_modes: tuple[str, ...] = MODES
    dirty_sample_seconds: tuple[int, ...] = (1, 2, 3)
    stream_bandwidth_mib: int = 256
    bandwidth_probe_mib: int = 64
    stall_timeout_s: float = 15.0
    setup_timeout_s: float = 60.0
    converge_timeout_s: float = 30.0
    recovery_timeout_s: float = 300.0
    postcopy_without_recovery: str = "warn"
    tcp_fabric_transport: str = "qemu-tcp"
    transport: str = "auto"


def read(conf: cfg.ConfigOpts) -> EngineOptions:
    """Read every option (oslo.config parses lazily) and check the cross-option rules.

    A bad value stops the service at start with a message naming the option,
    instead of failing the first live migration hours later.
    """
    group = conf[GROUP]
    values = {}
    for opt in migration_opts:
        try:
            values[opt.dest] = getattr(group, opt.dest)
        except (cfg.ConfigFileValueError, ValueError) as exc:
            raise InvalidConfig(group=GROUP, option=opt.name, reason=str(exc)) from exc
        # oslo.config's bounds compare false against NaN, so "nan" passes them.
        value = values[opt.dest]
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidConfig(
                group=GROUP, option=opt.name, reason=f"{value} is not a finite number"
            )
    if not values["allowed_modes"]:
        raise InvalidConfig(group=GROUP, option="allowed_modes", reason="name at least one mode")
    if len(set(values["dirty_sample_seconds"])) < 2:
        raise InvalidConfig(
            group=GROUP,
            option="dirty_sample_seconds",
            reason="needs at least two distinct lengths",
        )
    return EngineOptions(
        max_downtime_ms=values["max_downtime_ms"],
        allowed_modes=tuple(values["allowed_modes"]),
        dirty_sample_seconds=tuple(values["dirty_sample_seconds"]),
        stream_bandwidth_mib=values["stream_bandwidth_mib"],
        bandwidth_probe_mib=values["bandwidth_probe_mib"],
        stall_timeout_s=values["stall_timeout"],
        setup_timeout_s=values["setup_timeout"],
        converge_timeout_s=values["converge_timeout"],
        recovery_timeout_s=values["recovery_timeout"],
        postcopy_without_recovery=values["postcopy_without_recovery"],
        tcp_fabric_transport=values["tcp_fabric_transport"],
        transport=values["transport"],
    )
