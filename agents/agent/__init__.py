"""flexmig-agent: the per-host daemon (control API, host facts, split store, migrations)."""
