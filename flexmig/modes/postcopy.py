"""Hybrid postcopy: precopy rounds, then switch and pull the rest."""

from flexmig.modes.base import MigrationMode, ModeInfo


class PostcopyMode(MigrationMode):
    def describe(self) -> ModeInfo:
        return ModeInfo(
            name="postcopy",
            needs_postcopy=True,
            needs_file_backing=False,
            summary="precopy for the decision's rounds, then postcopy; recovers "
            "a broken postcopy when the link returns",
        )
