"""``cachectl``: the command line over the artifact store (``cachecompile.cli.main``).

Torch-free like the store it drives: a verb that needs torch (``build``) imports it when
it runs. This package imports nothing itself, so ``python -m cachecompile.cli.main``
finds its module unimported.
"""
