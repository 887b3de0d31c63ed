"""One module per event kind: ``arrival`` (a request reaches the cluster), ``step_end`` (an engine
iteration finishes). Transfers complete inside :mod:`kvtier.sim.resources`."""
