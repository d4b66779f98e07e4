"""The remote tiers, one module per server, behind one protocol.

::

    base     the Remote protocol (what tiered.py and cachectl use), RemoteConfig (the
             URL), the breaker, and BlobRemote: the one upload / download flow
    redis    RedisRemote: records, chunked blobs and pins as Redis keys
    s3       S3Remote: records, blobs and pins as objects in an S3-compatible bucket

:func:`open_remote` picks one by the URL's scheme. Neither client library is imported
until the first call that needs the network.
"""

from __future__ import annotations

from .base import (
    Breaker,
    RecordState,
    Remote,
    RemoteConfig,
    Uploaded,
    open_remote,
    redact,
)
from .redis import RedisRemote
from .s3 import S3Remote

__all__ = ["Breaker", "RecordState", "RedisRemote", "Remote", "RemoteConfig", "S3Remote",
           "Uploaded", "open_remote", "redact"]
