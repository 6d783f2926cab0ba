"""Building the product's wheel the way pip installs it, for the packaging tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BUILD_TIMEOUT_S = 300


def build(tree: Path, out: Path, env: dict[str, str] | None = None) -> Path:
    """The wheel of ``tree`` (pbr's PEP 517 backend, no dependencies) built into ``out``.

    Raises CalledProcessError with pip's output captured when the build fails."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(tree)],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
        env=env,
    )  # fmt: skip
    (wheel,) = out.glob("flexmig-*.whl")
    return wheel
