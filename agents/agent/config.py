"""flexmig-agent options (oslo.config), each with help, type, bounds and default."""

from __future__ import annotations

from oslo_config import cfg
from oslo_log import log

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
    cfg.StrOpt(
        "tls_cert_file",
        help="PEM certificate (with its chain) the control API serves over TLS, "
        "issued by the deployment's CA for this host's management address. "
        "Set with tls_key_file and tls_ca_file; unset means plain HTTP.",
    ),
    cfg.StrOpt("tls_key_file", help="PEM private key of tls_cert_file."),
    cfg.StrOpt(
        "tls_ca_file",
        help="The deployment's CA bundle: verifies the TLS certificates of peer "
        "agents this agent calls. Required when tls_cert_file is set.",
    ),
    cfg.FloatOpt(
        "socket_timeout",
        default=10.0,
        min=0.1,
        max=300.0,
        help="Seconds a client has to send its whole request (TLS handshake, "
        "headers and body) once connected; a connection that sends nothing "
        "for this long is closed without ever taking a worker.",
    ),
    cfg.IntOpt(
        "workers",
        default=16,
        min=1,
        max=256,
        help="Requests handled at once (a bounded pool); requests beyond "
        "workers + max_queued are refused by closing the connection.",
    ),
    cfg.IntOpt(
        "max_queued",
        default=64,
        min=0,
        max=4096,
        help="Requests that have started arriving and wait for a worker.",
    ),
    cfg.IntOpt(
        "expensive_workers",
        default=4,
        min=1,
        max=64,
        help="Expensive requests (plans and inventories, which sample dirty "
        "rates for seconds) run at most this many at once, so cheap ones "
        "(health, facts, migration status) never wait behind them. "
        "workers must exceed expensive_workers + expensive_queued.",
    ),
    cfg.IntOpt(
        "expensive_queued",
        default=4,
        min=0,
        max=256,
        help="Expensive requests that may wait for one of expensive_workers; "
        "beyond this they are refused at once with 503 and a Retry-After.",
    ),
    cfg.IntOpt(
        "max_idle_connections",
        default=1024,
        min=1,
        max=65536,
        help="Connections that sent nothing yet; beyond this the oldest is closed.",
    ),
    cfg.BoolOpt(
        "allow_orchestration",
        default=True,
        help="Serve the routes that start and plan migrations on this agent's "
        "own initiative (POST /v1/migrations, /v1/plan and the mover's "
        "routes under /v1/mover/). Set to false on hosts where Nova drives live "
        "migration, so no holder of the shared key can move VMs behind "
        "Nova's back: those routes then answer 403.",
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
    cfg.ListOpt(
        "sriov_failover_vfs",
        default=[],
        item_type=cfg.types.String(
            regex=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", max_length=12
        ),
        bounds=True,
        help="PCI addresses (0000:3b:02.1, ...) of this host's switchdev VFs the "
        "agent may hot-plug as the primary of an arriving VM's SR-IOV failover pair "
        "(a VF with <teaming type='transient'>, a virtio standby with "
        "<teaming type='persistent'>); the first one no domain has is used. Empty: "
        "arriving pairs keep their standby (onloaded) until a VF is attached. Hosts "
        "where Nova drives migration leave it empty: Nova attaches the VF it claimed.",
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
        help="Where split reservations for the libvirt hook are kept, and the "
        "movers' sockets and files; the logs of the 20 most recent failed movers "
        "stay there as mover-<id>-<role>.failed.log (agents/agent/mover_files.py); "
        "the agent's own migration records as migrations/<id>.json.",
    ),
    cfg.IntOpt(
        "dirty_sample_refresh",
        default=0,
        min=0,
        max=100,
        help="Seconds between background dirty-rate samplings of every running VM "
        "not migrating ([migration] dirty_sample_seconds, all VMs at once; not "
        "paused VMs, nor VMs held here under a split budget, whose pages the "
        "sampling would fault back from the store). A "
        "migration this agent plans (flexmig migrate, a drain), and one Nova's driver "
        "plans on this host (it takes them from this agent), fits every sampling of "
        "the last 120 s together instead of "
        "waiting the samples' length for new ones: several page-sampled "
        "calculations average out the noise of one, and longer samples (e.g. "
        "1,5,15, which make split's forecast steadier) then delay no migration. At "
        "least the sum of dirty_sample_seconds; 0 turns it off.",
    ),
    cfg.FloatOpt(
        "split_hot_sample_seconds",
        default=1.0,
        min=0.0,
        max=10.0,
        help="Before a split migration, how long to watch which 1 MiB chunks of "
        "the VM's memory file the guest writes (after writing the file back), so "
        "the destination keeps them resident from the first round "
        "(agents/agent/hot_chunks.py). A migration this agent drives samples while "
        "it is planned (beside the dirty-rate samples), whenever split may be "
        "chosen (mode split or auto); one Nova drives samples before the job "
        "starts, delaying it by this much plus the writeback. 0 turns it off: the "
        "destination then goes by what the migration stream sends again.",
    ),
    cfg.IntOpt(
        "reconcile_timeout",
        default=900,
        min=60,
        max=7 * 24 * 3600,
        help="Seconds a restarted agent follows a migration its predecessor left "
        "running (libvirt's job goes on without it) before it records the outcome "
        "as unsettled. Raise it where one migration can take longer (large VMs over "
        "slow links).",
    ),
    cfg.IntOpt(
        "migration_records_kept",
        default=50,
        min=1,
        max=10000,
        help="Ended migrations whose records the agent keeps in state_dir (the "
        "newest; older ones are deleted), so GET /v1/migrations/<id> still answers "
        "after the agent restarts.  Records of migrations still running are always kept.",
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
log.register_options(CONF)


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator."""
    return [("agent", agent_opts), *migration_options.list_opts()]


def check_tls(conf: cfg.ConfigOpts) -> None:
    """TLS is all three files or none."""
    files = {
        "tls_cert_file": conf.agent.tls_cert_file,
        "tls_key_file": conf.agent.tls_key_file,
        "tls_ca_file": conf.agent.tls_ca_file,
    }
    given = [name for name, value in files.items() if value]
    if given and len(given) != len(files):
        missing = sorted(set(files) - set(given))
        raise cfg.ConfigFileValueError(
            f"[agent] TLS needs tls_cert_file, tls_key_file and tls_ca_file; missing {missing}"
        )


def check_workers(conf: cfg.ConfigOpts) -> None:
    """Cheap requests keep workers that expensive ones can never hold (admission.py)."""
    held = conf.agent.expensive_workers + conf.agent.expensive_queued
    if conf.agent.workers <= held:
        raise cfg.ConfigFileValueError(
            f"[agent] workers ({conf.agent.workers}) must exceed expensive_workers + "
            f"expensive_queued ({held}), or health checks wait behind plans"
        )
