"""Running host commands with a timeout, and bounded waits.

Every external command has a timeout and a failure becomes a CommandFailed that
carries the command line and its stderr, so a failed step says which step.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from flexmig import exceptions

T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0


def run(
    cmd: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    check: bool = True,
    input_text: str | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` and return the completed process; raise CommandFailed on error."""
    try:
        proc = subprocess.run(
            list(cmd),
            input=input_text,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise exceptions.Timeout(seconds=timeout, what=shlex.join(cmd)) from exc
    except FileNotFoundError as exc:
        raise exceptions.MissingPrerequisite(
            what=cmd[0], hint="install it (tools/setup.sh installs what FlexMig needs)"
        ) from exc
    if check and proc.returncode != 0:
        raise exceptions.CommandFailed(
            cmd=shlex.join(cmd), rc=proc.returncode, stderr=proc.stderr.strip()[-2000:]
        )
    return proc


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
) -> T:
    """Poll ``probe`` until it returns a truthy value; raise Timeout naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise exceptions.Timeout(seconds=timeout, what=what)
        time.sleep(interval)
