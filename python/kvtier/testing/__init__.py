"""Helpers for tests and benchmarks, kept out of the product (issue 18, item 6).

- :mod:`kvtier.testing.redis`: throw-away loopback Redis/Valkey servers (:class:`LocalRedis`,
  :class:`LocalCluster`) on free ports outside the ephemeral range, stopped by pid, and
  :func:`command`, a one-shot RESP client for fixtures.

Nothing in the product imports ``kvtier.testing``, except the front ends that need a throw-away
server to run at all: the benchmarks (``kvtier.bench.remote``, ``kvtier.bench.engine``,
``kvtier.bench.vllm``: with no ``--url`` they start their own server) and the demo
(``kvtier.engine.replay``: the ``remote`` set-up of ``kvtier demo --engine``).
``tests/test_import_layers.py`` keeps it so, and keeps this package from importing the product.

Test hooks that must reach into the Rust side (``Store._corrupt_for_test``) stay on the class
they reach into.
"""
