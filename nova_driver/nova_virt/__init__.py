"""``nova.virt.nova_driver``: where Nova looks for ``compute_driver = nova_driver.…``.

Nova 34 loads its compute driver as ``nova.virt.<compute_driver>``, so the
documented ``compute_driver = nova_driver.driver.FlexMigLibvirtDriver`` is
imported as ``nova.virt.nova_driver.driver``.  setup.py installs this package
under that name; it only re-exports the driver.
"""
