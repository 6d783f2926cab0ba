"""What a FlexMig destination tells the source, carried in Nova's migrate data.

The destination's ``pre_live_migration`` returns its ``LibvirtLiveMigrateData``
to the source over Nova's compute RPC.  ``FlexMigLiveMigrateData`` is that
object plus one typed field, ``flexmig_offer``: a ``FlexMigOffer`` (its
agent's endpoint, a migration-scoped credential, its free memory and store,
the split reservation it made and, over the mover transport, the receiving
movers it started: a ``FlexMigMoverOffer``).  Both are registered versioned objects of
their own names and versions (``tests/unit/test_nova_objects.py`` holds their
hashes, as Nova's ``test_objects.py`` does for Nova's), so Nova's RPC
serializer carries them like any other; ``FlexMigLiveMigrateData`` is a
subclass, so every ``LibvirtLiveMigrateData`` check in Nova still holds.
Only computes running this driver ever see it: it is created in
``pre_live_migration`` and goes only from the destination compute to the
source compute and back (for rollback); the conductor only ever sees Nova's
own class.

``DestinationOffer`` is the same offer as a plain value for the pure planning
code; the versioned objects are only its wire form.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nova.objects import base as obj_base
from nova.objects import fields
from nova.objects import migrate_data as nova_migrate_data

from flexmig import exceptions

# Each FlexMigLiveMigrateData version and the LibvirtLiveMigrateData version it
# extends: the parent's compatibility rules are applied with the parent's
# version, never with ours.
PARENT_VERSIONS = {"1.0": "1.14"}


@dataclasses.dataclass(frozen=True)
class DestinationOffer:
    agent_address: str
    agent_port: int
    scope: str  # the credential's scope (auth.scope_for)
    scoped_key: str  # the key derived for that scope (auth.scoped_key)
    free_for_vms_bytes: int
    store_free_bytes: int
    split_budget_bytes: int | None  # the resident budget reserved, or None
    # The receiving movers it started, or None: the stream goes over QEMU's own TCP.
    mover: MoverOffer | None = None


@dataclasses.dataclass(frozen=True)
class MoverOffer:
    migration_id: str
    # The mover token is derived from this salt and the agents' key on both
    # ends (auth.mover_token): the token itself never crosses Nova's RPC.
    token_salt: str
    address: str  # where the receivers listen
    ports: tuple[int, ...]  # the main connection's first, then one per channel


@obj_base.NovaObjectRegistry.register
class FlexMigMoverOffer(obj_base.NovaObject):
    """The receiving movers on the wire (``MoverOffer``'s fields, typed)."""

    # Version 1.0: Initial version
    VERSION = "1.0"

    fields = {
        "migration_id": fields.StringField(),
        "token_salt": fields.StringField(),
        "address": fields.StringField(),
        "ports": fields.ListOfIntegersField(),
    }

    @classmethod
    def from_offer(cls, offer: MoverOffer) -> FlexMigMoverOffer:
        return cls(
            migration_id=offer.migration_id,
            token_salt=offer.token_salt,
            address=offer.address,
            ports=list(offer.ports),
        )

    def to_offer(self) -> MoverOffer:
        missing = [name for name in sorted(self.fields) if not self.obj_attr_is_set(name)]
        if missing:
            raise exceptions.InvalidInput(
                what="FlexMig migrate data",
                reason=f"the movers' offer lacks {', '.join(missing)}",
            )
        return MoverOffer(self.migration_id, self.token_salt, self.address, tuple(self.ports))


@obj_base.NovaObjectRegistry.register
class FlexMigOffer(obj_base.NovaObject):
    """The destination's offer on the wire (``DestinationOffer``'s fields, typed)."""

    # Version 1.0: Initial version
    VERSION = "1.0"

    fields = {
        "agent_address": fields.StringField(),
        "agent_port": fields.IntegerField(),
        "scope": fields.StringField(),
        # A (scoped, expiring) credential: never shown (__repr__).
        "scoped_key": fields.SensitiveStringField(),
        "free_for_vms_bytes": fields.IntegerField(),
        "store_free_bytes": fields.IntegerField(),
        "split_budget_bytes": fields.IntegerField(nullable=True),
        "mover": fields.ObjectField("FlexMigMoverOffer", nullable=True),
    }

    def __repr__(self) -> str:
        # Nova logs migrate data; a sensitive field only masks "password=…" text.
        shown = ", ".join(
            f"{name}={'***' if name == 'scoped_key' else repr(getattr(self, name))}"
            for name in sorted(self.fields)
            if self.obj_attr_is_set(name)
        )
        return f"FlexMigOffer({shown})"

    @classmethod
    def from_offer(cls, offer: DestinationOffer) -> FlexMigOffer:
        values = {f.name: getattr(offer, f.name) for f in dataclasses.fields(offer)}
        mover = values.pop("mover")
        return cls(**values, mover=None if mover is None else FlexMigMoverOffer.from_offer(mover))

    def to_offer(self) -> DestinationOffer:
        names = [f.name for f in dataclasses.fields(DestinationOffer) if f.name != "mover"]
        missing = [name for name in names if not self.obj_attr_is_set(name)]
        if missing:
            raise exceptions.InvalidInput(
                what="FlexMig migrate data",
                reason=f"the destination offer lacks {', '.join(missing)}",
            )
        # An offer from before the mover field was set has no movers.
        wire_mover = self.mover if self.obj_attr_is_set("mover") else None
        return DestinationOffer(
            **{name: getattr(self, name) for name in names},
            mover=None if wire_mover is None else wire_mover.to_offer(),
        )


@obj_base.NovaObjectRegistry.register
class FlexMigLiveMigrateData(nova_migrate_data.LibvirtLiveMigrateData):
    # Version 1.0: LibvirtLiveMigrateData 1.14 plus the typed FlexMig offer
    VERSION = "1.0"

    fields = {
        **nova_migrate_data.LibvirtLiveMigrateData.fields,
        "flexmig_offer": fields.ObjectField("FlexMigOffer", nullable=True),
    }

    def obj_make_compatible(self, primitive: dict[str, Any], target_version: str) -> None:
        # One version so far: nothing of ours to drop, only the parent's rules.
        parent = PARENT_VERSIONS.get(target_version)
        if parent is None:
            raise exceptions.InvalidInput(
                what="FlexMig migrate data", reason=f"no version {target_version} to send"
            )
        super().obj_make_compatible(primitive, parent)

    @classmethod
    def extend(
        cls, data: nova_migrate_data.LibvirtLiveMigrateData, offer: DestinationOffer
    ) -> FlexMigLiveMigrateData:
        extended = cls()
        for name in data.fields:
            if data.obj_attr_is_set(name):
                setattr(extended, name, getattr(data, name))
        extended.flexmig_offer = FlexMigOffer.from_offer(offer)
        return extended


def offer_of(data: object) -> DestinationOffer | None:
    """The destination's offer, or None when the destination does not run FlexMig."""
    if not isinstance(data, FlexMigLiveMigrateData) or not data.obj_attr_is_set("flexmig_offer"):
        return None
    if data.flexmig_offer is None:
        return None
    return data.flexmig_offer.to_offer()
