import setuptools

# Nova 34 imports compute_driver as "nova.virt.<value>": the driver is also
# installed as nova.virt.nova_driver (a re-export, nova_driver/nova_virt), so
# "compute_driver = nova_driver.driver.FlexMigLibvirtDriver" loads it.
setuptools.setup(
    packages=setuptools.find_packages(include=["flexmig", "flexmig.*", "agents", "agents.*",
                                               "nova_driver", "nova_driver.*", "ovs_ext",
                                               "ovs_ext.*"])
    + ["nova.virt.nova_driver"],
    package_dir={"nova.virt.nova_driver": "nova_driver/nova_virt"},
)
