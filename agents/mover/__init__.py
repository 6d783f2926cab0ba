"""The native data mover (C on libfabric); see src/ and the README."""

from pathlib import Path

MOVER_DIR = Path(__file__).parent
BINARY = MOVER_DIR / "build" / "flexmig-mover"
