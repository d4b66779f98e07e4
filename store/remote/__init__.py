"""The remote tiers, one module per server, behind one protocol.

::

    base     the Remote protocol (what tiered.py and cachectl use), RemoteConfig (the
             URL), the breaker, and BlobRemote: the one upload / download flow
    redis    RedisRemote: records, chunked blobs and pins as Redis keys
    s3       S3Remote: records, blobs and pins as objects in an S3-compatible bucket
    file     FileRemote: records, blobs and pins as files in a shared directory (NFS...)
    http     HttpRemote: records and blobs under /ac/ and /cas/ of an HTTP cache
    oci      OciRemote: an entry as an OCI artifact in a registry's repository
             (oci_format: the one mapping of a record to a manifest)
    oci_layout  OciLayoutRemote: the same artifacts in an OCI image-layout directory
             (cachectl export --oci, import)

Each server's class parses its own URL (``parse_url``) and registers its schemes
(``@register``); :func:`open_remote` picks one by the URL's scheme through that registry.
Importing this package imports every server's module, which fills the registry: a new
server is one module here and one import line below. Neither client library is imported
until the first call that needs the network. ``CACHECOMPILE_REMOTE`` may name a chain of
levels, nearest first (``file:///mnt/cc,s3://bucket/p``): :func:`open_levels` opens each,
and the tiered store (cachecompile.store.tiered) chains them.
"""

from __future__ import annotations

from .base import (
    Breaker,
    Listed,
    RecordState,
    Remote,
    RemoteConfig,
    Uploaded,
    open_levels,
    open_remote,
    redact,
    split_levels,
)
from .file import FileRemote
from .http import HttpRemote
from .oci import OciRemote
from .oci_layout import OciLayoutRemote
from .redis import RedisRemote
from .s3 import S3Remote

__all__ = ["Breaker", "FileRemote", "HttpRemote", "Listed", "OciLayoutRemote", "OciRemote", "RecordState", "RedisRemote",
           "Remote", "RemoteConfig", "S3Remote", "Uploaded", "open_levels", "open_remote",
           "redact", "split_levels"]
