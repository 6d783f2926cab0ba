"""Precopy: iterate until the remainder fits the downtime budget."""

from flexmig.modes.base import MigrationMode, ModeInfo


class PrecopyMode(MigrationMode):
    def describe(self) -> ModeInfo:
        return ModeInfo(
            name="precopy",
            needs_postcopy=False,
            needs_file_backing=False,
            summary="iterative precopy; auto-converge when the policy says it "
            "cannot converge otherwise",
        )
