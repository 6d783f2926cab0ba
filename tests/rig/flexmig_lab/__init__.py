"""The lab: several libvirt/OVS "hosts" in namespaces on one machine."""
