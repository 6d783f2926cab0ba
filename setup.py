import configparser

import setuptools

# Nova 34 imports compute_driver as "nova.virt.<value>": the driver is also
# installed as nova.virt.nova_driver (a re-export, nova_driver/nova_virt), so
# "compute_driver = nova_driver.driver.FlexMigLibvirtDriver" loads it. The
# packages themselves stay listed in setup.cfg ([options.packages.find]).
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
include = cfg["options.packages.find"]["include"].split()

setuptools.setup(
    packages=setuptools.find_packages(include=include) + ["nova.virt.nova_driver"],
    package_dir={"nova.virt.nova_driver": "nova_driver/nova_virt"},
)
