"""Driving ``udpgen`` (the lab's UDP generator and sink) and ``xdpgen`` (its
in-kernel generator: XDP live frames) in namespaces.

``prefix`` is any command prefix that enters a namespace (an endpoint's
``ip netns exec``, a host's ``nsenter``).  Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import select
import subprocess
import time
from pathlib import Path

from flexmig import exceptions
from flexmig_lab import errors

UDPGEN = Path(__file__).parent / "build" / "udpgen"
READY_TIMEOUT = 10.0


def _json_result(proc: subprocess.Popen, timeout: float, what: str, name: str) -> dict:
    """Wait (bounded) for a generator's exit and its one JSON line of totals."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        raise exceptions.Timeout(seconds=timeout, what=what) from exc
    if proc.returncode != 0:
        raise errors.LabError(reason=f"{name} failed: {err.strip()}")
    return json.loads(out)


def check_built() -> None:
    if not UDPGEN.is_file():
        raise exceptions.MissingPrerequisite(
            what=str(UDPGEN), hint="run tools/setup.sh (it builds the packet generator)"
        )


class Receiver:
    """A running ``udpgen recv``; :meth:`result` waits for its JSON line."""

    def __init__(
        self,
        prefix: list[str],
        port: int,
        *,
        count: int = 0,
        duration: float = 30.0,
        idle_ms: int = 1000,
    ) -> None:
        check_built()
        cmd = [*prefix, str(UDPGEN), "recv", "--port", str(port), "--duration", str(duration)]
        cmd += ["--idle-ms", str(idle_ms)]
        if count:
            cmd += ["--count", str(count)]
        self.timeout = duration + 10
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._wait_listening()

    def _wait_listening(self) -> None:
        assert self.proc.stderr is not None
        ready, _, _ = select.select([self.proc.stderr], [], [], READY_TIMEOUT)
        line = self.proc.stderr.readline() if ready else ""
        if "listening" not in line:
            self.proc.kill()
            raise errors.LabError(reason=f"udpgen receiver did not start: {line.strip()!r}")

    def result(self) -> dict[str, float]:
        return _json_result(self.proc, self.timeout, "udpgen receiver", "udpgen recv")


def send(
    prefix: list[str],
    dst: str,
    port: int,
    *,
    sport: int,
    count: int = 0,
    duration: float = 0.0,
    size: int = 18,
    rate: int = 0,
    batch: int = 64,
) -> dict[str, float]:
    """Send ``count`` datagrams (or for ``duration`` s); returns udpgen's totals."""
    check_built()
    cmd = [*prefix, str(UDPGEN), "send", "--dst", dst, "--port", str(port)]
    cmd += ["--sport", str(sport), "--size", str(size), "--batch", str(batch)]
    if count:
        cmd += ["--count", str(count)]
    if duration:
        cmd += ["--duration", str(duration)]
    if rate:
        cmd += ["--rate", str(rate)]
    timeout = (duration or 0) + (count / rate if rate else 0) + 30
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise errors.LabError(
            reason=f"udpgen send failed after {time.monotonic() - start:.1f} s: "
            f"{proc.stderr.strip()}"
        )
    return json.loads(proc.stdout)


# -- xdpgen: the in-kernel generator ---------------------------------------------------
XDPGEN = Path(__file__).parent / "build" / "xdpgen"
XDPGEN_OBJECT = XDPGEN.parent / "xdpgen.bpf.o"
XDPGEN_START_TIMEOUT = 30.0  # loading the program, before the first frame


def check_xdpgen_built() -> None:
    for built in (XDPGEN, XDPGEN_OBJECT):
        if not built.is_file():
            raise exceptions.MissingPrerequisite(
                what=str(built), hint="run tools/setup.sh (it builds xdpgen with libbpf)"
            )


@dataclasses.dataclass(frozen=True)
class XdpFlow:
    """The one UDP flow xdpgen repeats: a1's MAC/IP -> a2's MAC/IP/port."""

    src: str
    dst: str
    dst_mac: str
    port: int
    sport: int
    size: int = 18  # UDP payload: 60-byte frames, 64 on the wire

    def args(self) -> list[str]:
        return [
            "--src", self.src, "--dst", self.dst, "--dst-mac", self.dst_mac,
            "--port", str(self.port), "--sport", str(self.sport), "--size", str(self.size),
        ]  # fmt: skip


def xdp_frame(flow: XdpFlow, src_mac: str) -> bytes:
    """The template frame xdpgen would send (``--dump-frame``: no root, no device)."""
    check_xdpgen_built()
    proc = subprocess.run(
        [str(XDPGEN), "--dump-frame", "--src-mac", src_mac, *flow.args()],
        capture_output=True,
        text=True,
        timeout=XDPGEN_START_TIMEOUT,
        check=False,
    )
    if proc.returncode != 0:
        raise exceptions.InvalidInput(what="xdpgen flow", reason=proc.stderr.strip())
    return bytes.fromhex(proc.stdout.strip())


class XdpSender:
    """A running ``xdpgen`` in ``prefix``'s namespace, sending ``flow`` out of ``dev``.

    :meth:`result` waits for its JSON line: packets (frames generated), pps,
    xdp_xmit / xdp_xmit_errors / not_sent (what the device took or refused)
    and cpu_seconds (the generator's own CPU: it runs in its syscall).
    """

    def __init__(
        self,
        prefix: list[str],
        dev: str,
        flow: XdpFlow,
        *,
        count: int = 0,
        duration: float = 0.0,
        batch: int = 64,
    ) -> None:
        if bool(count) == bool(duration):
            raise exceptions.InvalidInput(
                what="xdpgen run", reason="give exactly one of count and duration"
            )
        check_xdpgen_built()
        cmd = [*prefix, str(XDPGEN), "--dev", dev, *flow.args(), "--batch", str(batch)]
        cmd += ["--count", str(count)] if count else ["--duration", str(duration)]
        self.timeout = duration + XDPGEN_START_TIMEOUT + (count / 100_000 if count else 0)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self) -> dict[str, float]:
        return _json_result(self.proc, self.timeout, "xdpgen", "xdpgen")


def xdp_send(
    prefix: list[str],
    dev: str,
    flow: XdpFlow,
    *,
    count: int = 0,
    duration: float = 0.0,
    batch: int = 64,
) -> dict[str, float]:
    """Run xdpgen to completion (``count`` frames or ``duration`` s); returns its totals."""
    return XdpSender(prefix, dev, flow, count=count, duration=duration, batch=batch).result()


class Sender:
    """A running ``udpgen send`` (paced, numbered and time-stamped datagrams);
    :meth:`result` waits for its totals.  ``batch=1`` paces every datagram, so
    a sequence number maps to its send time within the pacing's precision."""

    def __init__(
        self,
        prefix: list[str],
        dst: str,
        port: int,
        *,
        sport: int,
        count: int,
        rate: int,
        size: int = 64,
        batch: int = 1,
    ) -> None:
        check_built()
        if count <= 0 or rate <= 0:
            raise exceptions.InvalidInput(what="udpgen sender", reason="count and rate must be > 0")
        cmd = [*prefix, str(UDPGEN), "send", "--dst", dst, "--port", str(port)]
        cmd += ["--sport", str(sport), "--size", str(size), "--batch", str(batch)]
        cmd += ["--count", str(count), "--rate", str(rate)]
        self.timeout = count / rate + 30
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self) -> dict[str, float]:
        return _json_result(self.proc, self.timeout, "udpgen sender", "udpgen send")
