"""FlexMig's versioned objects, held to their hashes as Nova's test_objects.py holds Nova's.

A change to a field (or to the LibvirtLiveMigrateData fields a new Nova brings)
changes the hash: bump the object's VERSION, teach obj_make_compatible the old
one (and PARENT_VERSIONS the parent it extends), then update the hash here.
(No FlexMig release has shipped these objects yet: until the first tag, 1.0
still changes in place.)
"""

from __future__ import annotations

import pytest
from nova.objects import base as obj_base
from nova.objects import migrate_data as nova_migrate_data
from oslo_versionedobjects import fixture

from nova_driver import migrate_data

OBJECT_DATA = {
    "FlexMigLiveMigrateData": "1.0-b493104bd1f42a1ec9eff5852d007ebc",
    "FlexMigMoverOffer": "1.0-c9360dc0ab0d0d71b28f835f91178c7c",
    "FlexMigOffer": "1.0-141bc62cd694cc1fef5b1cdb0630c70b",
}


def test_versions_match_hashes() -> None:
    checker = fixture.ObjectVersionChecker(
        {name: [getattr(migrate_data, name)] for name in OBJECT_DATA}
    )
    expected, actual = checker.test_hashes(OBJECT_DATA)
    assert expected == actual, "an object changed: bump its VERSION (module docstring)"


def test_the_parent_version_is_the_one_nova_has() -> None:
    extends = migrate_data.PARENT_VERSIONS[migrate_data.FlexMigLiveMigrateData.VERSION]
    assert extends == nova_migrate_data.LibvirtLiveMigrateData.VERSION


def test_registered_under_their_own_names() -> None:
    classes = obj_base.NovaObjectRegistry.obj_classes()
    for name in OBJECT_DATA:
        assert classes[name][0] is getattr(migrate_data, name)


def _offer() -> migrate_data.DestinationOffer:
    return migrate_data.DestinationOffer(
        agent_address="10.250.0.12",
        agent_port=9797,
        scope="migration/m1/instance-00000001/1800000000",
        scoped_key="cd" * 32,
        free_for_vms_bytes=1 << 30,
        store_free_bytes=8 << 30,
        split_budget_bytes=None,
    )


def test_sent_at_its_own_version_the_parent_fields_survive() -> None:
    data = nova_migrate_data.LibvirtLiveMigrateData(
        block_migration=True, dst_wants_file_backed_memory=True
    )
    extended = migrate_data.FlexMigLiveMigrateData.extend(data, _offer())
    primitive = extended.obj_to_primitive(target_version="1.0")
    received = obj_base.NovaObject.obj_from_primitive(primitive)
    assert received.dst_wants_file_backed_memory is True
    assert migrate_data.offer_of(received) == _offer()


def test_an_unknown_target_version_is_refused() -> None:
    extended = migrate_data.FlexMigLiveMigrateData.extend(
        nova_migrate_data.LibvirtLiveMigrateData(block_migration=False), _offer()
    )
    with pytest.raises(Exception, match="no version 0.9 to send"):
        extended.obj_to_primitive(target_version="0.9")


def test_the_credential_never_shows_in_logs() -> None:
    data = migrate_data.FlexMigLiveMigrateData.extend(
        nova_migrate_data.LibvirtLiveMigrateData(block_migration=False), _offer()
    )
    assert "cdcd" not in repr(data)
    shown = repr(data.flexmig_offer)
    assert "scoped_key=***" in shown and "cdcd" not in shown and "10.250.0.12" in shown
