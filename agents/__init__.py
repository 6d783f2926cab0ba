"""FlexMig agents (see README)."""
