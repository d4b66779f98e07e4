"""cachecompile's version: one leaf module, so that the key (``key.factors``) can name it
without importing the package face."""

__version__ = "0.1.0"
