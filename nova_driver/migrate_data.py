"""What a FlexMig destination tells the source, carried in Nova's migrate data.

The destination's ``pre_live_migration`` returns its ``LibvirtLiveMigrateData``
to the source over Nova's compute RPC.  ``FlexMigLiveMigrateData`` is that
object plus one field, ``flexmig``: a JSON ``DestinationOffer`` (its agent's
endpoint, a migration-scoped credential, its free memory and store, the
split reservation it made and the receiving movers it started).  It is a
registered versioned object of its own name, so Nova's RPC serializer
carries it like any other, and a subclass, so every ``LibvirtLiveMigrateData``
check in Nova still holds.  Only computes running this driver ever see it: it
is created in ``pre_live_migration`` and goes only from the destination
compute to the source compute and back (for rollback); the conductor only
ever sees Nova's own class.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from nova.objects import base as obj_base
from nova.objects import fields
from nova.objects import migrate_data as nova_migrate_data

from flexmig import exceptions


@dataclasses.dataclass(frozen=True)
class DestinationOffer:
    agent_address: str
    agent_port: int
    scope: str  # the credential's scope (auth.scope_for)
    scoped_key: str  # the key derived for that scope (auth.scoped_key)
    free_for_vms_bytes: int
    store_free_bytes: int
    split_budget_bytes: int | None  # the resident budget reserved, or None
    # The receiving movers it started ({"migration_id", "token", "ports"}), or
    # None: the stream goes over QEMU's own TCP.
    mover: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DestinationOffer:
        try:
            data: dict[str, Any] = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise exceptions.InvalidInput(
                what="FlexMig migrate data", reason=f"cannot read the destination offer: {exc}"
            ) from exc


@obj_base.NovaObjectRegistry.register
class FlexMigLiveMigrateData(nova_migrate_data.LibvirtLiveMigrateData):
    # Version 1.14: LibvirtLiveMigrateData 1.14 plus the FlexMig offer.  The
    # version follows the parent's so its obj_make_compatible rules apply.
    VERSION = "1.14"

    fields = {
        **nova_migrate_data.LibvirtLiveMigrateData.fields,
        # Sensitive: it holds a (scoped, expiring) credential; Nova masks it in logs.
        "flexmig": fields.SensitiveStringField(nullable=True),
    }

    @classmethod
    def extend(
        cls, data: nova_migrate_data.LibvirtLiveMigrateData, offer: DestinationOffer
    ) -> FlexMigLiveMigrateData:
        extended = cls()
        for name in data.fields:
            if data.obj_attr_is_set(name):
                setattr(extended, name, getattr(data, name))
        extended.flexmig = offer.to_json()
        return extended


def offer_of(data: object) -> DestinationOffer | None:
    """The destination's offer, or None when the destination does not run FlexMig."""
    if not isinstance(data, FlexMigLiveMigrateData) or not data.obj_attr_is_set("flexmig"):
        return None
    if data.flexmig is None:
        return None
    return DestinationOffer.from_json(data.flexmig)
