"""The one migration engine that the Nova driver, the agents and the CLI all call.

- ``request``: what a migration is asked to do (one object, validated once);
- ``options``: the ``[migration]`` options both nova-compute and the agent read;
- ``facts``: the I/O edge that reads a VM's memory and dirty-rate facts;
- ``planner``: pure functions from request + facts to a ``Plan`` (over ``flexmig.policy``);
- ``controller``: what to do next in a running libvirt job (postcopy switch,
  in-flight correction, stall watchdog), as pure decisions;
- ``libvirt_job``: the agent's executor of a plan over a libvirt domain
  (the Nova driver's executor is ``nova_driver.monitor``, over Nova's Guest).
"""
