"""FlexMig ovs_ext (see README)."""
