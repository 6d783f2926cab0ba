"""The offload extension on a lab host: flexmig-offload controlling its br-int.

Each host runs ``flexmig-offload`` inside its namespaces like its agent: the
OpenFlow controller listens on the host's own loopback (its network namespace),
``br-int`` connects to it with fail-mode standalone, and the statistics
endpoint sits in the host's OVS rundir, so inside the host
``ovs-ofctl dump-flows br-int-offload`` shows the offloaded flows.

The provider is ``FLEXMIG_LAB_OFFLOAD_PROVIDER`` (default ``xdp``); when that
plugin is not installed the host runs without the extension and its status
says so.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from typing import TYPE_CHECKING

from flexmig import processutil
from flexmig_lab import errors, topology

if TYPE_CHECKING:
    from flexmig_lab.host import LabHost

PROVIDER_NAMESPACE = "flexmig.offload_providers"
STATUS_FILE = "/run/flexmig/offload-status.json"
PID_FILE = "/run/flexmig/offload.pid"
ENDPOINT_NAME = f"{topology.INTEGRATION_BRIDGE}-offload"
ENDPOINT_SOCKET = f"/run/openvswitch/{ENDPOINT_NAME}.mgmt"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# The lab's standing policy: nothing by header, elephants by statistics.
DEFAULT_POLICY = """\
capacity: 1024
header_rules: []
statistics:
  window_s: 0.5
  promote_pps: 20000
  demote_pps: 2000
  demote_intervals: 5
"""


def lab_provider() -> str:
    return os.environ.get("FLEXMIG_LAB_OFFLOAD_PROVIDER", "xdp")


def provider_installed(name: str) -> bool:
    return any(ep.name == name for ep in metadata.entry_points(group=PROVIDER_NAMESPACE))


VM_PORT_PATTERNS = (r"tap\d+", r"ep-[a-z0-9]+")
CONTROL_SOCKET = "/run/flexmig/offload-control.sock"


def offload_conf(
    provider: str,
    policy_file: str,
    poll_interval: float,
    extra: str = "",
    key_file: str = "",
    options: str = "",
) -> str:
    """The service's config file; ``extra`` adds sections (e.g. [offload_xdp]),
    ``options`` more ``[offload]`` lines (e.g. ``pipeline = neutron``).

    With ``key_file`` (the lab's agent key) the control interface the host's
    agent moves migrating VMs' flows through is served on CONTROL_SOCKET.
    """
    return extra + "\n".join(
        [
            "[offload]",
            f"provider = {provider}",
            f"policy_file = {policy_file}",
            f"bridge = {topology.INTEGRATION_BRIDGE}",
            f"poll_interval = {poll_interval}",
            f"stats_endpoint = {ENDPOINT_SOCKET}",
            f"status_file = {STATUS_FILE}",
            f"uplinks = {topology.HOST_TENANT_IF}",
            # The lab's VM taps (tapN) and traffic endpoints (ep-NAME), not Nova's.
            f"vm_port_patterns = {','.join(VM_PORT_PATTERNS)}",
            # Fresh OVS counters every 100 ms: promotion within 200 ms
            # (docs/benchmarks/offload-control.md).
            "ovs_revalidator_ms = 100",
            f"control_socket = {CONTROL_SOCKET if key_file else ''}",
            f"control_key_file = {key_file}",
            options,
            "",
        ]
    )


class LabOffload:
    """Start, stop, reconfigure and read one host's flexmig-offload."""

    def __init__(self, host: LabHost) -> None:
        self.host = host
        self.conf_file = host.dir / "offload.conf"
        self.policy_file = host.dir / "offload-policy.yaml"
        self.log_file = host.dir / "offload.log"

    def running(self) -> bool:
        try:
            pid = int(self.host.ns.root_path(PID_FILE).read_text())
        except (FileNotFoundError, ValueError, errors.LabNotUp):
            return False
        return self.host.ns.pid_alive(pid)

    def start(
        self,
        policy_text: str | None = None,
        provider: str | None = None,
        poll_interval: float = 0.1,
        wait: bool = True,
        extra_conf: str = "",
        options: str = "",
    ) -> None:
        """(Re)start the service with this policy and provider."""
        self.stop()
        provider = provider or lab_provider()
        if policy_text is not None or not self.policy_file.exists():
            self.policy_file.write_text(DEFAULT_POLICY if policy_text is None else policy_text)
        self.conf_file.write_text(
            offload_conf(
                provider,
                str(self.policy_file),
                poll_interval,
                extra_conf,
                str(self.host.dir.parents[1] / "agent.key"),
                options,
            )
        )
        self.host.ns.root_path(STATUS_FILE).unlink(missing_ok=True)
        script = (
            f"echo $$ > {PID_FILE}; exec {sys.executable} -m ovs_ext.service "
            f"--config-file {self.conf_file}"
        )
        proc = self.host.ns.spawn(["sh", "-c", script], self.log_file)
        if wait:
            self.wait_ready(proc)

    def wait_ready(self, proc: object | None = None) -> None:
        status = self.host.ns.root_path(STATUS_FILE)

        def ready() -> bool:
            if proc is not None and proc.poll() is not None:  # type: ignore[attr-defined]
                raise errors.LabError(
                    reason=f"flexmig-offload on {self.host.name} exited: {self.log_tail()}"
                )
            try:
                shown = json.loads(status.read_text())
            except (FileNotFoundError, ValueError):
                return False
            # Judging: the app's rules are in and the datapath's cached flows purged.
            return bool(shown.get("bridge", {}).get("judging"))

        processutil.wait_for(
            ready,
            timeout=START_TIMEOUT,
            what=f"flexmig-offload on host {self.host.name} (see {self.log_file})",
        )

    def stop(self) -> None:
        """SIGTERM: the service hands every flow back to the bridge, then exits."""
        if not self.running():
            return
        self.host.ns.run(["sh", "-c", f"kill -TERM $(cat {PID_FILE})"], check=False)
        processutil.wait_for(
            lambda: not self.running(),
            timeout=STOP_TIMEOUT,
            what=f"flexmig-offload on {self.host.name} to stop",
        )

    def crash(self) -> None:
        """SIGKILL: the service dies without handing anything back (its rules stay
        in the bridge, its entries pinned in the provider)."""
        if not self.running():
            return
        self.host.ns.run(["sh", "-c", f"kill -KILL $(cat {PID_FILE})"], check=False)
        processutil.wait_for(
            lambda: not self.running(),
            timeout=STOP_TIMEOUT,
            what=f"flexmig-offload on {self.host.name} to die",
        )

    def reload(self, policy_text: str) -> None:
        """Write a new policy and send SIGHUP (the service rejects an invalid one)."""
        self.policy_file.write_text(policy_text)
        self.host.ns.run(["sh", "-c", f"kill -HUP $(cat {PID_FILE})"])

    def status(self) -> dict[str, object]:
        return json.loads(self.host.ns.root_path(STATUS_FILE).read_text())

    def dump_flows(self, *args: str) -> str:
        """``ovs-ofctl dump-flows br-int-offload`` inside the host, as an operator runs it."""
        return self.host.ns.run(["ovs-ofctl", "dump-flows", ENDPOINT_NAME, *args]).stdout

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


def start_if_available(host: LabHost) -> bool:
    """At lab up: run the extension when its provider is installed."""
    if not provider_installed(lab_provider()):
        (host.dir / "offload.log").write_text(
            f"offload provider {lab_provider()!r} is not installed; extension not started\n"
        )
        return False
    LabOffload(host).start()
    return True


def running(host: LabHost) -> bool:
    return LabOffload(host).running()
