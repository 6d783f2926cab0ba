"""``flexmig-offload``: the offload extension's service on one host.

Loads the policy (an invalid one stops the start, naming the field, before
anything touches the bridge), the configured provider through stevedore, then
runs the os-ken app on a loopback address, points the bridge at it and
serves the statistics endpoint.  SIGHUP re-reads the policy (an invalid file
is rejected whole: the running policy and every flow stay as they are);
SIGTERM gives every flow back to the bridge and detaches the fast path,
keeping every flow's counters in the counters file for the next start.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from oslo_config import cfg
from oslo_log import log
from stevedore import driver

from agents.agent import auth
from flexmig import exceptions
from ovs_ext import config, control_api, neutron, policy, restore, stats_reader
from ovs_ext.app import Runtime, write_status
from ovs_ext.control import OffloadControl
from ovs_ext.dispatcher import Dispatchers
from ovs_ext.openflow_stats import config as stats_config
from ovs_ext.openflow_stats.server import OpenFlowStatsServer
from ovs_ext.openflow_stats.session import EndpointInfo
from ovs_ext.providers.base import FlowCounters, FlowMatch, OffloadProvider

LOG = logging.getLogger("flexmig.ovs_ext.service")
OVS_VSCTL_TIMEOUT = 10
CONTROLLER_WAIT = 30.0
# Beside Neutron: how often the app checks its controller is still in the list.
CONTROLLER_CHECK_EVERY = 5.0
SHUTDOWN_TIMEOUT = 3.0
STATS_READ_TIMEOUT = 5.0  # one poll through [offload] stats_socket


class OffloadServiceError(exceptions.FlexMigError):
    msg_fmt = "flexmig-offload: %(reason)s"


def load_provider(conf: cfg.ConfigOpts, name: str) -> OffloadProvider:
    """The named provider plugin, its options registered under [offload_<name>]."""
    try:
        manager = driver.DriverManager(
            namespace=config.PROVIDER_NAMESPACE, name=name, invoke_on_load=False
        )
    except Exception as exc:
        raise OffloadServiceError(
            reason=f"offload provider {name!r} could not be loaded: {exc}"
        ) from exc
    provider_cls = manager.driver
    conf.register_opts(provider_cls.CONFIG_OPTS, group=f"offload_{name.replace('-', '_')}")
    provider = provider_cls(conf)
    description = provider.describe()
    if not description.available:
        raise OffloadServiceError(
            reason=f"offload provider {name} cannot run here: {description.unavailable_reason}"
        )
    return provider


def bridge_datapath_id(bridge: str) -> int:
    """The bridge's datapath id: the only switch the app accepts."""
    proc = subprocess.run(
        ["ovs-vsctl", f"--timeout={OVS_VSCTL_TIMEOUT}", "get", "bridge", bridge, "datapath_id"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise OffloadServiceError(reason=f"bridge {bridge}: {proc.stderr.strip()}")
    return int(proc.stdout.strip().strip('"'), 16)


def configure_bridge(bridge: str, target: str, revalidator_ms: int = 0) -> None:
    """Controller at ``target``, fail-mode standalone, OpenFlow 1.0 and 1.3."""
    cmd = [
        "ovs-vsctl",
        f"--timeout={OVS_VSCTL_TIMEOUT}",
        "set-controller",
        bridge,
        target,
        "--",
        "set-fail-mode",
        bridge,
        "standalone",
        "--",
        "set",
        "bridge",
        bridge,
        "protocols=OpenFlow10,OpenFlow13",
    ]
    if revalidator_ms:
        cmd += ["--", "set", "Open_vSwitch", ".", f"other_config:max-revalidator={revalidator_ms}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise OffloadServiceError(
            reason=f"could not set {bridge}'s controller: {proc.stderr.strip()}"
        )


def _start_osken(runtime: Runtime, address: str, port: int) -> list[object]:
    from os_ken import cfg as osken_cfg
    from os_ken.base import app_manager

    osken_cfg.CONF([], project="os_ken")
    osken_cfg.CONF.set_override("ofp_listen_host", address)
    # An explicit port also stops os-ken from opening its legacy 6633 listener.
    osken_cfg.CONF.set_override("ofp_tcp_listen_port", port)
    manager = app_manager.AppManager.get_instance()
    manager.load_apps(["ovs_ext.app"])
    contexts = manager.create_contexts()
    return manager.instantiate_apps(offload_runtime=runtime, **contexts)


def _start_stats_endpoint(conf: cfg.ConfigOpts, runtime: Runtime) -> OpenFlowStatsServer | None:
    """The OpenFlow statistics endpoint ovs-ofctl reads, fed by the Flow Manager."""
    path = conf.offload.stats_endpoint
    if not path:
        return None
    opts = conf.openflow_stats

    def records() -> list[object]:
        app = runtime.app
        if app is None:
            return []
        with runtime.lock:
            return runtime.control.flows.records(app.ofport_of)

    def port_names() -> dict[int, str]:
        return dict(runtime.app.port_names) if runtime.app is not None else {}

    server = OpenFlowStatsServer(
        records,
        unix_socket=path,
        unix_socket_mode=int(opts.unix_socket_mode, 8),
        max_connections=opts.max_connections,
        idle_timeout=opts.idle_timeout,
        port_names=port_names,
        info=EndpointInfo(datapath_id=runtime.datapath_id or 0),
        dump_reuse_s=opts.dump_reuse_s,
    )
    server.start()
    return server


def _start_control_api(conf: cfg.ConfigOpts, runtime: Runtime) -> None:
    """The agent's way in: a VM's flows across a live migration."""
    path = conf.offload.control_socket
    if not path:
        return
    key = auth.load_key(conf.offload.control_key_file)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    control_api.serve(runtime, path, key)


def take_stale_entries(provider: OffloadProvider, name: str) -> dict[FlowMatch, FlowCounters]:
    """Entries a previous run left in the provider (its tables may be pinned):
    removed, since their flows are not tracked yet and must not keep bypassing
    the bridge; their final counters are returned so the flows' counts go on."""
    stale = provider.stats()
    if not stale:
        return {}
    final = provider.remove(list(stale))
    LOG.info("took %d stale entries from provider %s", len(stale), name)
    return {match: final.get(match, counters) for match, counters in stale.items()}


def prepare(argv: list[str]) -> tuple[cfg.ConfigOpts, Runtime]:
    """Everything that can be refused, before anything listens or the bridge is touched."""
    conf = cfg.ConfigOpts()
    config.register_opts(conf)
    stats_config.register_opts(conf)
    log.register_options(conf)
    conf(argv, project="flexmig", prog="flexmig-offload")
    config.validate(conf)
    opts = conf.offload
    active_policy = policy.load_policy(opts.policy_file)
    provider = load_provider(conf, opts.provider)
    check_listen(opts.controller_address, opts.controller_port)
    datapath_id = bridge_datapath_id(opts.bridge)
    stale = take_stale_entries(provider, opts.provider)
    pipeline, guard = neutron_mode(opts)
    dispatchers = Dispatchers(provider, opts.provider, opts.vm_port_patterns, opts.uplinks)
    control = OffloadControl(
        active_policy,
        provider,
        opts.provider,
        dispatchers,
        idle_timeout=opts.flow_idle_timeout,
        offload_guard=guard,
    )
    for match, counters in stale.items():
        control.flows.restore(match, offloaded=counters)
    take_kept_counters(control, opts.counters_file)
    runtime = Runtime(control, opts.bridge, opts.poll_interval, opts.status_file)
    runtime.datapath_id = datapath_id
    runtime.pipeline = pipeline
    socket_path = stats_socket_path(opts.stats_socket, opts.bridge)
    if socket_path:
        runtime.stats_reader = stats_reader.FlowStatsReader(socket_path, timeout=STATS_READ_TIMEOUT)
    return conf, runtime


def stats_socket_path(setting: str, bridge: str) -> str:
    """The management socket polls read through ([offload] stats_socket); empty:
    the controller connection.  'auto' is the bridge's own in OVS's rundir,
    when it is there.

    >>> stats_socket_path("", "br-int")
    ''
    >>> stats_socket_path("/tmp/x.mgmt", "br-int")
    '/tmp/x.mgmt'
    """
    if setting != config.STATS_SOCKET_AUTO:
        return setting
    rundir = os.environ.get("OVS_RUNDIR") or "/var/run/openvswitch"
    path = os.path.join(rundir, f"{bridge}.mgmt")
    if not os.path.exists(path):
        LOG.warning("no %s: statistics are read through the controller connection", path)
        return ""
    return path


def take_kept_counters(control: OffloadControl, path: str) -> int:
    """The counters a clean stop kept (restore.kept_at_stop), taken once: the
    file goes, so a later crash restart never adds them a second time.  A file
    that cannot be read restores nothing and is set aside, named in the log."""
    if not path or not os.path.exists(path):
        return 0
    try:
        with open(path, encoding="utf-8") as handle:
            kept = restore.from_document(control.flows, json.load(handle))
    except (OSError, ValueError) as exc:
        aside = f"{path}.rejected"
        LOG.error("counters file %s not used (%s); kept as %s", path, exc, aside)
        os.replace(path, aside)
        return 0
    os.unlink(path)
    LOG.info("counters of %d flows kept by the last clean stop", kept)
    return kept


def neutron_mode(
    opts: cfg.ConfigOpts,
) -> tuple[neutron.NeutronPipeline | None, Callable[[FlowMatch, str | None], str] | None]:
    """The pipeline and offload guard beside Neutron's agent; (None, None) standalone."""
    if opts.pipeline != "neutron":
        return None, None
    pipeline = neutron.NeutronPipeline(
        opts.neutron_table,
        opts.neutron_counting_table,
        opts.neutron_register,
        opts.neutron_controller_id,
    )
    return pipeline, neutron.NeutronGuard(opts.neutron_ports_file).why_not


def check_listen(address: str, port: int) -> None:
    """os-ken binds in a thread and only logs a failure: find it here instead."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise OffloadServiceError(
                reason=f"cannot listen on {address}:{port} for the bridge: {exc.strerror}"
            ) from exc


def main(argv: list[str] | None = None) -> int:
    try:
        conf, runtime = prepare(sys.argv[1:] if argv is None else argv)
        endpoint = _start_stats_endpoint(conf, runtime)
        _start_control_api(conf, runtime)
    except (cfg.Error, exceptions.FlexMigError, OSError) as exc:
        print(f"flexmig-offload: {exc}", file=sys.stderr)
        return 2
    log.setup(conf, "flexmig-offload")
    opts = conf.offload
    LOG.info(
        "provider %s (capacity %d), policy %s, bridge %s",
        opts.provider,
        runtime.control.capacity,
        opts.policy_file,
        opts.bridge,
    )
    _start_osken(runtime, opts.controller_address, opts.controller_port)
    _install_signal_handlers(runtime, opts.policy_file)
    rc = 0
    target = f"tcp:{opts.controller_address}:{opts.controller_port}"
    beside_neutron = runtime.pipeline is not None
    try:
        if opts.configure_bridge and beside_neutron:
            neutron.check_openflow13(opts.bridge)
            neutron.ensure_controller(opts.bridge, target)
            set_revalidator(opts.ovs_revalidator_ms)
        elif opts.configure_bridge:
            configure_bridge(opts.bridge, target, opts.ovs_revalidator_ms)
        if not runtime.connected.wait(CONTROLLER_WAIT):
            LOG.error("bridge %s did not connect within %.0f s", opts.bridge, CONTROLLER_WAIT)
        while not runtime.stopping.wait(CONTROLLER_CHECK_EVERY):
            if opts.configure_bridge and beside_neutron:
                # Neutron's agent resets the list to its own if it finds its
                # controller missing (e.g. after an OVS restart).
                neutron.ensure_controller(opts.bridge, target)
    except exceptions.FlexMigError as exc:
        LOG.error("%s", exc)
        rc = 1
    bridge = opts.bridge if opts.configure_bridge else None
    _shutdown(runtime, endpoint, bridge, target if beside_neutron else None, opts.counters_file)
    logging.shutdown()
    # os-ken's hub threads are not daemons and have no stop: leave without them.
    os._exit(rc)


def _install_signal_handlers(runtime: Runtime, policy_file: str) -> None:
    def reload(_sig: int, _frame: FrameType | None) -> None:
        threading.Thread(target=reload_policy, args=(runtime, policy_file), daemon=True).start()

    def stop(_sig: int, _frame: FrameType | None) -> None:
        runtime.stopping.set()

    signal.signal(signal.SIGHUP, reload)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def reload_policy(runtime: Runtime, policy_file: str) -> bool:
    """Re-read the policy; an invalid file changes nothing and says why."""
    try:
        new_policy = policy.load_policy(policy_file)
    except policy.PolicyError as exc:
        LOG.error("policy reload rejected, running policy kept: %s", exc)
        return False
    with runtime.lock:
        runtime.control.replace_policy(new_policy)
    LOG.info("policy reloaded from %s", policy_file)
    return True


def set_revalidator(revalidator_ms: int) -> None:
    """ovs-vsctl's other_config:max-revalidator (switch-wide; 0: left alone)."""
    if not revalidator_ms:
        return
    setting = f"other_config:max-revalidator={revalidator_ms}"
    cmd = ["ovs-vsctl", f"--timeout={OVS_VSCTL_TIMEOUT}", "set", "Open_vSwitch", ".", setting]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise OffloadServiceError(reason=f"could not set {setting}: {proc.stderr.strip()}")


def _shutdown(
    runtime: Runtime,
    endpoint: OpenFlowStatsServer | None,
    bridge: str | None,
    own_controller: str | None = None,
    counters_file: str = "",
) -> None:
    """Every offloaded flow back to the bridge, the fast path detached, every
    flow's counters kept in ``counters_file``, the bridge back to its own NORMAL
    switching."""
    LOG.info("stopping: flows go back to the bridge")
    runtime.stopping.set()
    control = runtime.control
    gone = []
    with runtime.lock:
        for port in sorted(control.dispatchers.fast_path_ports):
            gone += control.port_removed(port)
    app = runtime.app
    if counters_file:
        # After the fast path is detached (its flows' packets are the rules' now)
        # and just before the rules go: the only packets left uncounted are
        # those in the few milliseconds between this read and the deletion.
        stats = app.read_rules(SHUTDOWN_TIMEOUT) if app is not None else None
        if stats is None:
            LOG.warning("rules not read at stop: counters kept as last polled")
        keep_counters(runtime, gone, stats or [], counters_file)
    if app is not None and not app.remove_judging_rules(SHUTDOWN_TIMEOUT):
        LOG.warning("bridge did not confirm the removal of the app's rules")
    if endpoint is not None:
        endpoint.stop()
    if bridge is not None and own_controller is not None:
        try:  # beside Neutron: only the app's own controller record goes
            neutron.remove_controller(bridge, own_controller)
        except neutron.NeutronModeError as exc:
            LOG.warning("%s", exc)
    elif bridge is not None:
        subprocess.run(
            ["ovs-vsctl", f"--timeout={OVS_VSCTL_TIMEOUT}", "del-controller", bridge],
            capture_output=True,
            check=False,
        )


def keep_counters(runtime: Runtime, gone: list[Any], stats: list[Any], path: str) -> None:
    app = runtime.app
    port_name = app.port_names.get if app is not None else {}.get
    with runtime.lock:
        kept = restore.kept_at_stop(runtime.control.flows, gone, stats, port_name)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_status(path, restore.counters_document(kept))
    except OSError as exc:
        LOG.error("could not keep the counters of %d flows in %s: %s", len(kept), path, exc)
        return
    LOG.info("counters of %d flows kept in %s", len(kept), path)


if __name__ == "__main__":
    sys.exit(main())
