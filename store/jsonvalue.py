"""The type of a value as stored (a manifest, an entry's meta): shared by every floor above
the store (imports nothing)."""

from __future__ import annotations

from typing import Any

# A value as it is stored: what json.dumps writes and json.loads gives back (dicts, lists,
# str, int, float, bool, None). Typed as Any: mypy cannot spell a recursive JSON type
# that accepts the dicts the code builds without a cast at every use.
JSON = Any
