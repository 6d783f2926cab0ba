"""The ``tc-flower`` offload provider: switchdev SR-IOV NIC eswitches.

``messages`` builds and parses the rtnetlink messages (pyroute2), ``probe``
says whether this machine can run it, ``provider`` is the plugin.
"""

from ovs_ext.providers.tc_flower.provider import CONFIG_OPTS, TcFlowerProvider

__all__ = ["CONFIG_OPTS", "TcFlowerProvider"]
