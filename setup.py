import setuptools
from setuptools import dist

# The one mapping pbr's setup.cfg cannot express: Nova 34 imports
# compute_driver as "nova.virt.<value>", so the driver's re-export
# (nova_driver/nova_virt) is installed as nova.virt.flexmig and
# "compute_driver = flexmig.FlexMigLibvirtDriver" loads it.
SHIM = "nova.virt.flexmig"


class Distribution(dist.Distribution):
    def finalize_options(self) -> None:
        super().finalize_options()  # pbr fills packages from setup.cfg here
        self.packages = sorted({*(self.packages or []), SHIM})


setuptools.setup(
    setup_requires=["pbr>=6.0.0"],
    pbr=True,
    distclass=Distribution,
    package_dir={SHIM: "nova_driver/nova_virt"},
)
