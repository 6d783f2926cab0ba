"""The ``xdp`` offload provider: an eSwitch fast path in XDP/eBPF."""
