import pytest

from flexmig import exceptions
from flexmig_lab import image

# The shape of a real modules.dep (paths relative, transitive deps listed).
NET = "kernel/drivers/net"
VIRTIO = "kernel/drivers/virtio"
FAILOVER = "kernel/net/core/failover.ko"
MODULES_DEP = f"""\
{NET}/virtio_net.ko: {NET}/net_failover.ko {FAILOVER} {VIRTIO}/virtio_ring.ko {VIRTIO}/virtio.ko
{NET}/net_failover.ko: {FAILOVER}
{FAILOVER}:
{VIRTIO}/virtio_pci.ko: {VIRTIO}/virtio_pci_modern_dev.ko {VIRTIO}/virtio_ring.ko {VIRTIO}/virtio.ko
{VIRTIO}/virtio_pci_modern_dev.ko:
{VIRTIO}/virtio_ring.ko:
{VIRTIO}/virtio.ko:
"""


def test_dependencies_load_before_their_users():
    order = image.module_load_order(MODULES_DEP, ("virtio_pci", "virtio_net"))
    names = [p.rsplit("/", 1)[1] for p in order]
    assert len(names) == len(set(names)) == 7
    for user, dep in [
        ("virtio_net.ko", "net_failover.ko"),
        ("net_failover.ko", "failover.ko"),
        ("virtio_pci.ko", "virtio_ring.ko"),
        ("virtio_ring.ko", "virtio.ko"),
        ("virtio_net.ko", "virtio_pci.ko"),
    ]:
        if user == "virtio_net.ko" and dep == "virtio_pci.ko":
            assert names.index(dep) < names.index(user)  # requested order kept
        else:
            assert names.index(dep) < names.index(user), (dep, user)


def test_missing_module_is_a_clear_error():
    with pytest.raises(exceptions.MissingPrerequisite, match="kernel module e1000"):
        image.module_load_order(MODULES_DEP, ("e1000",))
