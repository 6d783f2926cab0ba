"""flexmig-agent options (oslo.config), each with help, type, bounds and default."""

from __future__ import annotations

from oslo_config import cfg

from agents.agent.client import DEFAULT_PORT
from flexmig.migration import options as migration_options

agent_opts = [
    cfg.IPOpt(
        "listen_address",
        required=True,
        help="Address the control API listens on: the host's management address. "
        "The agent never listens on all addresses.",
    ),
    cfg.PortOpt("port", default=DEFAULT_PORT, help="TCP port of the control API."),
    cfg.StrOpt(
        "unix_socket",
        help="Also serve the API on this UNIX socket (mode 0600), for tools on the "
        "same host. Requests on it are authenticated like any other.",
    ),
    cfg.StrOpt(
        "key_file",
        required=True,
        help="File holding the deployment's shared key (at least 16 bytes) that "
        "signs every request between agents, the CLI and the Nova driver.",
    ),
    cfg.StrOpt("libvirt_uri", default="qemu:///system", help="This host's libvirt."),
    cfg.StrOpt(
        "offload_control_socket",
        default="/run/flexmig/offload-control.sock",
        help="The offload extension's local control interface (its [offload] "
        "control_socket): a migrating VM's offloaded flows are demoted, carried to "
        "the destination and re-offloaded there through it. Empty, or no extension "
        "running: VMs migrate without it.",
    ),
    cfg.IntOpt(
        "memory_budget_mb",
        default=0,
        min=0,
        max=16 * 1024 * 1024,
        help="RAM this host gives VMs, in MiB; the free budget reported to "
        "migration sources is this minus the RAM of running VMs. 0 means "
        "the host's MemAvailable.",
    ),
    cfg.StrOpt(
        "store_dir",
        required=True,
        help="Split store: where VM memory files live (qemu.conf memory_backing_dir).",
    ),
    cfg.StrOpt(
        "cgroup_parent",
        default="flexmig",
        regex=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        help="Memory-cgroup directory (under the cgroup-v1 memory mount) holding "
        "split mode's per-VM groups; must match the libvirt hook's "
        "FLEXMIG_CGROUP_PARENT.",
    ),
    cfg.StrOpt(
        "state_dir",
        default="/run/flexmig",
        help="Where split reservations for the libvirt hook are kept.",
    ),
]


def register_opts(conf: cfg.ConfigOpts) -> None:
    """The agent's own options and the engine's (``[migration]``, with their old
    ``[agent]`` names as deprecated aliases)."""
    conf.register_opts(agent_opts, group="agent")
    migration_options.register_opts(conf)


# The agent's own object: processes that import agent code (the Nova driver,
# tests) must not find required [agent] options on their global cfg.CONF.
CONF = cfg.ConfigOpts()
register_opts(CONF)


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator."""
    return [("agent", agent_opts), *migration_options.list_opts()]
