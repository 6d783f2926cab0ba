"""Migration policy: the dirty-page model, precopy simulation, the mode decision.

Plain functions fed with data; no I/O.  The CLI, the agents and the Nova driver
gather the inputs and act on the decision.
"""
