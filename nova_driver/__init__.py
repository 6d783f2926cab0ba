"""FlexMig nova_driver (see README)."""
