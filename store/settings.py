"""Every ``CACHECOMPILE_*`` environment variable, in one table: its name, parser, default
and what it does (vLLM's ``vllm/envs.py`` keeps its variables the same way).

Every module reads its variable here, ``settings.MAX_SIZE.get()``, never through
``os.environ`` (``tests/store/test_settings.py`` greps for the other spelling), so that
each variable is parsed one way wherever it is read:

* one truthiness rule for switches: ``1``, ``true``, ``yes``, ``on`` are on, ``0``,
  ``false``, ``no``, ``off`` and the empty string off, in any case;
* a value that does not parse warns once (:class:`~cachecompile.store.errors.SettingWarning`,
  naming the variable, the value and what was expected) and the default is used; a
  variable with no safe default (``strict``) raises ``StoreInputError`` naming it instead;
* the docs' tables of variables (docs/usage.md, README.md) are made from this table by
  :func:`markdown_table` (``python tools/settings_docs.py --write`` rewrites them;
  a test keeps them equal).

A variable whose value is a list of names checked elsewhere (``CPU_TARGET``: the CPU
levels ``cachecompile.key.cpu`` knows) is read here as text, and its reader reports a bad
value through :meth:`Setting.invalid`, so the warning is the same. Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from .config import parse_bool, parse_size
from .errors import SettingWarning, StoreInputError

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREFIX = "CACHECOMPILE_"
_UNSET: Any = object()
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``get()`` is its value, parsed, or its default."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    shown: str = ""           # the default as the docs say it (else repr of ``default``)
    strict: bool = False      # no safe default: a bad value raises, naming the variable
    secret: bool = False      # never echoed in a message
    blank: Any = _UNSET       # the value of a variable set to "" (default: as if unset)
    readme: bool = False      # also in README.md's short table

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as set (None: unset)."""
        return (os.environ if env is None else env).get(self.name)

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return self.raw(env) is not None

    def get(self, env: Mapping[str, str] | None = None) -> T:
        """The parsed value, or the default (unset, empty, or, with one warning, bad)."""
        raw = self.raw(env)
        if raw is None:
            return self.default
        if raw.strip() == "":
            return self.default if self.blank is _UNSET else self.blank
        try:
            return self.parse(raw)
        except (ValueError, StoreInputError) as e:
            return self.invalid(raw, str(e))

    def invalid(self, raw: str, problem: str) -> T:
        """A value that does not parse: once per value and process a ``SettingWarning``
        naming the variable and the default used; ``strict``: ``StoreInputError``."""
        shown = "(the value is secret)" if self.secret else f"={raw!r}"
        message = f"{self.name}{shown}: {problem}"
        if self.strict:
            raise StoreInputError(f"{message}; fix or unset {self.name}")
        with _warned_lock:
            if (self.name, raw) in _warned:
                return self.default
            _warned.add((self.name, raw))
        warnings.warn(f"{message}; using the default ({self.shown_default.replace('`', '')})",
                      SettingWarning,
                      stacklevel=_outside_stacklevel())
        return self.default

    @property
    def shown_default(self) -> str:
        """The default as the docs and the warnings say it."""
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return "`on`" if self.default else "`off`"
        return f"`{self.default}`"


def _outside_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first frame outside cachecompile, its store
    and torch (the caller's line, however deep the read)."""
    skip = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for name in ("cachecompile", "torch"):
        where = getattr(sys.modules.get(name), "__file__", None)
        if where:
            skip.append(os.path.dirname(os.path.abspath(where)) + os.sep)
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(tuple(skip)):
        frame = frame.f_back
        level += 1
    return level


# -- parsers -------------------------------------------------------------------------------
def _text(raw: str) -> str:
    return raw.strip()


def _path(raw: str) -> str:
    return os.path.expanduser(raw.strip())


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("not a number of seconds (e.g. 900, 2.5)") from None
    if value < 0 or value != value:
        raise ValueError("not a number of seconds >= 0")
    return value


def _positive(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError("not a whole number (e.g. 4)") from None
    if value < 1:
        raise ValueError("not a whole number >= 1")
    return value


def _flag(raw: str) -> bool:
    return parse_bool(raw)


def _size(raw: str) -> int:
    try:
        return parse_size(raw)
    except StoreInputError:
        raise ValueError("not a size (e.g. 10G, 512M, 1000000)") from None


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"not one of {', '.join(allowed)}")
        return value
    return parse


def _log_level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("not a logging level (DEBUG, INFO, WARNING, ERROR)")
    return value


# -- the table -----------------------------------------------------------------------------
DIR = Setting(
    "CACHECOMPILE_DIR", _path, "",
    "store root (`cache_compile(cache_dir=)` and `cachectl --cache-dir` win over it)",
    shown="`$XDG_CACHE_HOME/cachecompile`, else `~/.cache/cachecompile`", readme=True)
DISABLE = Setting(
    "CACHECOMPILE_DISABLE", _flag, False,
    "no caching: every cached method runs as plain `torch.compile` with the same contract",
    blank=False, readme=True)
READONLY = Setting(
    "CACHECOMPILE_READONLY", _flag, False, "look up only, never publish", blank=False,
    readme=True)
MAX_SIZE = Setting(
    "CACHECOMPILE_MAX_SIZE", _size, 10 * 1024**3, "size cap of the store, e.g. `10G`, `512M`",
    shown="`10G`", readme=True)
SHARED_GROUP: Setting[bool | None] = Setting(
    "CACHECOMPILE_SHARED_GROUP", _flag, None,
    "accept (`1`) or refuse (`0`) a group-owned team cache (never a world-writable one)",
    shown="a store made by `cachectl init --shared` is accepted", blank=False, readme=True)
LOCK_TIMEOUT = Setting(
    "CACHECOMPILE_LOCK_TIMEOUT", _seconds, 900.0,
    "seconds a process waits for another's compile of the same key", shown="`900`",
    readme=True)
COMPILE_SLOTS: Setting[int | None] = Setting(
    "CACHECOMPILE_COMPILE_SLOTS", _positive, None,
    "compiles at once per node (and `cachectl build`'s workers)", shown="CPU count / 2",
    readme=True)
GUARDS = Setting(
    "CACHECOMPILE_GUARDS", _choice("always", "first"), "always",
    "when a loaded entry's guards run: `always` or `first` (`cache_compile(guards=)` wins)")
CPU_TARGET = Setting(
    "CACHECOMPILE_CPU_TARGET", _text, "",
    "what CPU kernels are built for and keyed by: `native`, `x86-64-v2`/`-v3`/`-v4`, or "
    "`auto` / a comma list (the best level this CPU has; one image for a mixed fleet, "
    "docs/deploy.md); an unknown name warns and builds `native` (`cachectl build` refuses it)",
    shown="`native`", readme=True)
REMOTE = Setting(
    "CACHECOMPILE_REMOTE", _text, "",
    "the remote tier: `redis://host:port/db[?mode=ro]`, `s3://bucket/prefix[?mode=ro]` "
    "(with the `AWS_*` variables; `pip install 'cachecompile[s3]'`), `file:///mnt/shared/cc` "
    "(NFS, FSx, a PVC), `http(s)://host/prefix` (bazel-remote, nginx WebDAV) or "
    "`oci://registry/repository` (an OCI registry: Harbor, ECR, distribution); a comma "
    "list chains levels, nearest first (docs/remote.md)",
    shown="none", readme=True)
REMOTE_PASSWORD = Setting(
    "CACHECOMPILE_REMOTE_PASSWORD", _text, "",
    "the Redis, HTTP or OCI registry tier's password (never in the URL; over HTTP with no "
    "user name, a bearer token)",
    shown="none", secret=True)
REMOTE_PASSWORD_FILE = Setting(
    "CACHECOMPILE_REMOTE_PASSWORD_FILE", _path, "",
    "a file whose first line is the Redis, HTTP or OCI registry tier's password (a "
    "mounted secret)",
    shown="none")
REMOTE_FLUSH_TIMEOUT = Setting(
    "CACHECOMPILE_REMOTE_FLUSH_TIMEOUT", _seconds, 5.0,
    "seconds a process waits at exit for its uploads to the remote tier", shown="`5`")
REMOTE_QUEUE = Setting(
    "CACHECOMPILE_REMOTE_QUEUE", _positive, 64,
    "uploads queued for the remote tier before new ones are dropped")
SIGNING_KEY = Setting(
    "CACHECOMPILE_SIGNING_KEY", _text, "",
    "HMAC key (or `file:PATH`) that signs and verifies remote records and bundles",
    shown="none", secret=True, readme=True)
VERIFY_KEYS = Setting(
    "CACHECOMPILE_VERIFY_KEYS", _text, "",
    "more keys (comma-separated, each a value or `file:PATH`) that verify, for a key rotation",
    shown="none", secret=True)
TRUST_REMOTE = Setting(
    "CACHECOMPILE_TRUST_REMOTE", _flag, False,
    "accept unsigned remote records and bundles (their entries are code)", blank=False,
    readme=True)
STATS_DIR = Setting(
    "CACHECOMPILE_STATS_DIR", _path, "",
    "where read-only processes write their counters (for `cachectl stats` and a collector)",
    shown="`/tmp/cachecompile-UID/stats/...`")
BUILD_SHARD = Setting(
    "CACHECOMPILE_BUILD_SHARD", _text, "",
    "`cachectl build --shard I/N`'s default (`auto`: from the job engine's variables)",
    shown="none")
BUILD_LOG = Setting(
    "CACHECOMPILE_BUILD_LOG", _log_level, "WARNING",
    "logging level of `cachectl build`'s workers (`INFO` shows each hit and miss)")
TEST_CPU_FLAGS = Setting(
    "CACHECOMPILE_TEST_CPU_FLAGS", _text, "",
    "for tests only: the CPU flags the CPU-target check reads instead of /proc/cpuinfo's "
    "(a process told of flags its CPU lacks loads kernels that die of SIGILL)", shown="none")


def table() -> Iterator[Setting[Any]]:
    """Every setting, in the table's order."""
    for value in globals().values():
        if isinstance(value, Setting):
            yield value


def by_name(name: str) -> Setting[Any]:
    for s in table():
        if s.name == name:
            return s
    raise KeyError(name)


# -- names that are none of the above ------------------------------------------------------
# Read by this project's own tests and CI scripts, not by the package: never "unknown".
DEVELOPMENT_PREFIXES = ("CACHECOMPILE_TEST_", "CACHECOMPILE_REQUIRE_")
DEVELOPMENT_NAMES = frozenset(PREFIX + n for n in (
    "GUARD_SWEEP", "GUARD_SWEEP_SEED", "WRITE_SWEEP", "WRITE_SWEEP_SEED", "SUITE_BUDGET_S",
    "TIER_PREFETCH_GB", "TORCH_MATRIX", "NPU_MATRIX"))
_checked_names = False


def unknown_names(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``CACHECOMPILE_*`` variable set that no setting reads (a misspelling, ``..._DISABLED``
    for ``..._DISABLE``), with the setting it most likely meant (or None), by the part
    after the prefix (which every name shares)."""
    import difflib

    known = [st.name for st in table()]
    suffixes = {n[len(PREFIX):]: n for n in known}
    out = []
    for name in sorted(os.environ if env is None else env):
        if (not name.startswith(PREFIX) or name in known or name in DEVELOPMENT_NAMES
                or name.startswith(DEVELOPMENT_PREFIXES)):
            continue
        near = difflib.get_close_matches(name[len(PREFIX):], list(suffixes), n=1, cutoff=0.75)
        out.append((name, suffixes[near[0]] if near else None))
    return out


def warn_unknown_names() -> None:
    """One :class:`SettingWarning` per process for each ``CACHECOMPILE_*`` variable no
    setting reads: a value is checked when it is read, a name only here (called by
    ``cache_compile()`` and ``cachectl``)."""
    global _checked_names
    if _checked_names:
        return
    _checked_names = True
    if not any(n.startswith(PREFIX) for n in os.environ):
        return
    for name, near in unknown_names():
        hint = f"did you mean {near}? " if near else ""
        warnings.warn(f"{name} is set, but no cachecompile setting has that name, so it is "
                      f"ignored; {hint}The settings are listed in docs/usage.md "
                      "(\"Environment variables\").", SettingWarning,
                      stacklevel=_outside_stacklevel())


# -- the docs ------------------------------------------------------------------------------
def markdown_table(readme: bool = False) -> str:
    """The docs' table of variables (README.md's: the ``readme`` ones only)."""
    rows = ["| variable | default | effect |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {s.shown_default} | {s.doc} |" for s in table()
             if s.readme or not readme]
    return "\n".join(rows) + "\n"


BEGIN = "<!-- settings: made by store/settings.py (python tools/settings_docs.py --write) -->"
END = "<!-- /settings -->"
DOCS = {"README.md": True, "docs/usage.md": False}   # file -> README's short table


def replaced(text: str, readme: bool) -> str:
    """``text`` with the block between :data:`BEGIN` and :data:`END` made anew."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {BEGIN!r} ... {END!r} block")
    return pattern.sub(lambda _: f"{BEGIN}\n{markdown_table(readme)}{END}", text)
