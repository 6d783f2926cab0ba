"""FlexMig: per-VM live-migration mode selection and flow offload for OpenStack."""

__version__ = "0.1.0"
