"""nova.conf for the FlexMig driver: ``[flexmig]`` (how it reaches the agents) and
the engine's ``[migration]`` (how migrations are planned and run, shared with
the agents; its options' old ``[flexmig]`` names stay as deprecated aliases).

Every option has help, type, bounds and a default; ``validate`` reads them all
at service start so a bad value stops nova-compute with a message naming the
option, instead of failing the first live migration hours later.
"""

from __future__ import annotations

import math

from oslo_config import cfg

from agents.agent.client import DEFAULT_PORT
from flexmig.migration import options as migration_options
from flexmig.migration.options import EngineOptions, InvalidConfig

GROUP = "flexmig"
__all__ = ["InvalidConfig", "list_opts", "register_opts", "validate"]

flexmig_opts = [
    cfg.HostAddressOpt(
        "agent_address",
        help="Address of this host's flexmig-agent control API (its [agent] "
        "listen_address). Unset means Nova's [DEFAULT] my_ip. The destination "
        "hands it to the source in the migrate data.",
    ),
    cfg.PortOpt(
        "agent_port", default=DEFAULT_PORT, min=1, help="TCP port of the flexmig-agent API."
    ),
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
        "credential_ttl",
        default=3600,
        min=60,
        max=86400,
        help="Lifetime (s) of the migration-scoped credential a destination "
        "hands to the source.",
    ),
]


def register_opts(conf: cfg.ConfigOpts) -> None:
    conf.register_opts(flexmig_opts, group=GROUP)
    migration_options.register_opts(conf)


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator (entry point ``flexmig.nova``)."""
    return [(GROUP, flexmig_opts), *migration_options.list_opts()]


def validate(conf: cfg.ConfigOpts) -> EngineOptions:
    """Read every option (oslo.config parses lazily); the engine's, as plain values."""
    for opt in flexmig_opts:
        try:
            value = getattr(conf[GROUP], opt.dest)
        except (cfg.ConfigFileValueError, ValueError) as exc:
            raise InvalidConfig(group=GROUP, option=opt.name, reason=str(exc)) from exc
        # oslo.config's bounds compare false against NaN, so "nan" passes them.
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidConfig(
                group=GROUP, option=opt.name, reason=f"{value} is not a finite number"
            )
    return migration_options.read(conf)
