"""The lab's own errors: the product's exceptions know nothing of the lab."""

from __future__ import annotations

from flexmig.exceptions import FlexMigError


class LabError(FlexMigError):
    msg_fmt = "Lab error: %(reason)s"


class LabNotUp(LabError):
    msg_fmt = "The lab is not up (%(reason)s). Run 'flexmig-lab up' first."
