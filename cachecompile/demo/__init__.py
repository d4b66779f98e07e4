"""``python -m cachecompile.demo``: a cold process, then a warm one, side by side; and the
small models the demo, the tests and the benchmarks use (``models``)."""
