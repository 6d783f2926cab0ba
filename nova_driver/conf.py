"""The ``[flexmig]`` group of nova.conf: how the Nova driver reaches agents and plans.

Every option has help, type, bounds and a default; ``validate`` reads them all
at service start so a bad value stops nova-compute with a message naming the
option, instead of failing the first live migration hours later.
"""

from __future__ import annotations

import math

from oslo_config import cfg, types

from flexmig import exceptions

GROUP = "flexmig"
MODES = ("precopy", "postcopy", "split")

flexmig_opts = [
    cfg.HostAddressOpt(
        "agent_address",
        help="Address of this host's flexmig-agent control API (its [agent] "
        "listen_address). Unset means Nova's [DEFAULT] my_ip. The destination "
        "hands it to the source in the migrate data.",
    ),
    cfg.PortOpt("agent_port", default=9797, min=1, help="TCP port of the flexmig-agent API."),
    cfg.StrOpt(
        "agent_key_file",
        default="/etc/flexmig/agent.key",
        help="File holding the deployment's shared agent key (the agents' [agent] "
        "key_file). nova-compute signs its agent requests with it and derives "
        "the migration-scoped credentials it hands to a migration's source.",
    ),
    cfg.StrOpt(
        "agent_ca_file",
        help="The deployment's CA bundle. Set it when the agents serve TLS "
        "([agent] tls_cert_file): nova-compute then reaches every agent over "
        "TLS and verifies its certificate against this CA. Unset means plain HTTP.",
    ),
    cfg.FloatOpt(
        "agent_timeout",
        default=10.0,
        min=1.0,
        max=300.0,
        help="Seconds to wait for one agent request before the migration is "
        "refused (before it starts) or rolled back.",
    ),
    cfg.IntOpt(
        "max_downtime_ms",
        default=300,
        min=1,
        max=60000,
        help="Downtime budget (ms) the policy plans migrations for; it replaces "
        "[libvirt] live_migration_downtime for FlexMig migrations.",
    ),
    cfg.ListOpt(
        "allowed_modes",
        item_type=types.String(choices=MODES),
        default=list(MODES),
        help="Modes the policy may choose. Without postcopy a non-converging "
        "precopy is throttled (auto-converge); without split a destination "
        "short of RAM is refused.",
    ),
    cfg.ListOpt(
        "dirty_sample_seconds",
        item_type=types.Integer(min=1, max=30),
        default=[1, 2, 4],
        help="Lengths (s) of the dirty-rate samples (libvirt domdirtyrate-calc) "
        "the dirty-page model is fitted to before each migration; at least two "
        "distinct values. Their sum delays the start of every migration.",
    ),
    cfg.IntOpt(
        "stream_bandwidth_mib",
        default=256,
        min=1,
        max=1_000_000,
        help="Migration stream bandwidth (MiB/s) the policy assumes, capped by "
        "the fabric's probed rate and by [libvirt] live_migration_bandwidth.",
    ),
    cfg.IntOpt(
        "bandwidth_probe_mib",
        default=64,
        min=0,
        max=256,
        help="MiB pulled from the destination agent to measure the fabric before "
        "planning; 0 skips the probe and trusts stream_bandwidth_mib.",
    ),
    cfg.FloatOpt(
        "stall_timeout",
        default=60.0,
        min=1.0,
        max=3600.0,
        help="Seconds without migration progress before a precopy is aborted "
        "(the VM keeps running on the source).",
    ),
    cfg.IntOpt(
        "credential_ttl",
        default=3600,
        min=60,
        max=86400,
        help="Lifetime (s) of the migration-scoped credential a destination "
        "hands to the source.",
    ),
]


class InvalidConfig(exceptions.FlexMigError):
    msg_fmt = "Invalid [flexmig] %(option)s: %(reason)s"


def register_opts(conf: cfg.ConfigOpts) -> None:
    conf.register_opts(flexmig_opts, group=GROUP)


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator (entry point ``flexmig.nova``)."""
    return [(GROUP, flexmig_opts)]


def validate(conf: cfg.ConfigOpts) -> None:
    """Read every option (oslo.config parses lazily) and check the cross-option rules."""
    for opt in flexmig_opts:
        try:
            value = getattr(conf[GROUP], opt.dest)
        except (cfg.ConfigFileValueError, ValueError) as exc:
            raise InvalidConfig(option=opt.name, reason=str(exc)) from exc
        # oslo.config's bounds compare false against NaN, so "nan" passes them.
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidConfig(option=opt.name, reason=f"{value} is not a finite number")
    group = conf[GROUP]
    if not group.allowed_modes:
        raise InvalidConfig(option="allowed_modes", reason="name at least one mode")
    if len(set(group.dirty_sample_seconds)) < 2:
        raise InvalidConfig(
            option="dirty_sample_seconds", reason="needs at least two distinct lengths"
        )
