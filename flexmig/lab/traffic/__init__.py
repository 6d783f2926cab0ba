"""Driving ``udpgen`` (the lab's UDP generator and sink) in namespaces.

``prefix`` is any command prefix that enters a namespace (an endpoint's
``ip netns exec``, a host's ``nsenter``).  Every wait is bounded.
"""

from __future__ import annotations

import json
import select
import subprocess
import time
from pathlib import Path

from flexmig import exceptions

UDPGEN = Path(__file__).parent / "build" / "udpgen"
READY_TIMEOUT = 10.0


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
            raise exceptions.LabError(reason=f"udpgen receiver did not start: {line.strip()!r}")

    def result(self) -> dict[str, float]:
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            raise exceptions.Timeout(seconds=self.timeout, what="udpgen receiver") from exc
        if self.proc.returncode != 0:
            raise exceptions.LabError(reason=f"udpgen recv failed: {err.strip()}")
        return json.loads(out)


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
        raise exceptions.LabError(
            reason=f"udpgen send failed after {time.monotonic() - start:.1f} s: "
            f"{proc.stderr.strip()}"
        )
    return json.loads(proc.stdout)
