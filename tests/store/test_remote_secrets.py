"""A remote's password is never printed (issue 32).

The marker password holds every character that splits or breaks a URL parse (``/``,
``#``, ``?``, ``@``); it goes into URLs of every scheme, raw and percent-encoded, and
every place a URL reaches a human is searched for it and for each of its pieces:
``cachectl``'s remote verbs (output and exit), ``open_store()``'s errors, a serving
process's CacheFaultWarning, the log (caplog), reprs. The password can also come from
``CACHECOMPILE_REMOTE_PASSWORD`` or ``CACHECOMPILE_REMOTE_PASSWORD_FILE``, and then
works against a real redis-server that requires it.

Every test here failed before its fix.
"""

from __future__ import annotations

import logging
import urllib.parse
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis_util import RedisServer, free_port

from cachecompile.cli.main import cli
from cachecompile.store import errors, make_key, open_store
from cachecompile.store.remote import RemoteConfig, open_remote, redact

PIECES = ("S3cretAlpha", "S3cretBravo", "S3cretCharlie", "S3cretDelta", "S3cretEcho")
MARKER = "S3cretAlpha/S3cretBravo#S3cretCharlie?S3cretDelta@S3cretEcho"
ENCODED = urllib.parse.quote(MARKER, safe="")


def leaks(text: str) -> list[str]:
    """The marker, its encoded form, or any piece of it, found in ``text``."""
    return [p for p in (MARKER, ENCODED, *PIECES) if p in text]


def urls(port: int, sock: Path, tls_port: int | None = None) -> list[str]:
    """The marker in the URLs of every scheme, where a password can go (``tls_port``: a
    port for rediss://, where nothing speaks TLS, so that the handshake fails at once)."""
    out = []
    for pw in (MARKER, ENCODED):
        out += [
            f"redis://:{pw}@127.0.0.1:{port}/0",
            f"redis://default:{pw}@127.0.0.1:{port}/0",
            f"redis://:{pw}@127.0.0.1:{port}/0?mode=ro&timeout=2",
            f"rediss://:{pw}@127.0.0.1:{tls_port or port}/0",
            f"unix://:{pw}@{sock}?db=0",
            f"redis://127.0.0.1:{port}/0?password={pw}",
            f"s3://:{pw}@bucket-name/prefix",
            f"s3://AKIAEXAMPLE:{pw}@bucket-name/prefix",
            # an HTTP cache: Basic with a user, a bearer token without (the server here
            # is Redis, or nothing: the verbs fail, and must say nothing of the password)
            f"http://fleet:{pw}@127.0.0.1:{port}/cc",
            f"https://:{pw}@127.0.0.1:{tls_port or port}/cc?mode=ro",
            # malformed besides: a port that is no number, a bad mode, another scheme
            f"redis://:{pw}@127.0.0.1:notaport/0",
            f"redis://:{pw}@127.0.0.1:{port}/0?mode=sometimes",
            f"http://:{pw}@127.0.0.1:{port}/0",
        ]
    return out


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_SIGNING_KEY", "CACHECOMPILE_TRUST_REMOTE",
                "CACHECOMPILE_DIR", "CACHECOMPILE_READONLY", "CACHECOMPILE_VERIFY_KEYS",
                "CACHECOMPILE_REMOTE_PASSWORD", "CACHECOMPILE_REMOTE_PASSWORD_FILE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that requires the marker as its password."""
    srv = RedisServer(tmp_path / "redis").start()
    srv.client().config_set("requirepass", MARKER)  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def test_redact_masks_the_password_however_the_url_is_malformed() -> None:
    for url in urls(6379, Path("/run/redis.sock")):
        shown = redact(url)
        assert leaks(shown) == [], (url, shown)
    # What is not secret stays readable.
    assert redact("redis://cache.internal:6379/0") == "redis://cache.internal:6379/0"
    assert redact(f"redis://alice:{MARKER}@cache:6379/0") == "redis://alice:***@cache:6379/0"


def test_no_parse_error_or_config_shows_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for url in urls(free_port(), Path("/run/redis.sock")):
        try:
            c = RemoteConfig.parse(url)
        except errors.RemoteConfigError as e:
            assert leaks(str(e)) == [], (url, str(e))
            assert "CACHECOMPILE_REMOTE" in str(e)
            continue
        shown = [repr(c), str(c), c.display, c.url, c.target]
        assert leaks(" ".join(shown)) == [], (url, shown)
        r = open_remote(c)
        assert leaks(repr(r)) == [], (url, repr(r))
    assert leaks(caplog.text) == []


def test_a_raw_password_with_url_characters_works(guarded: RedisServer, tmp_path: Path) -> None:
    # Not percent-encoded: everything up to the URL's last "@" is the password.
    for pw in (MARKER, ENCODED):
        c = RemoteConfig.parse(f"redis://:{pw}@127.0.0.1:{guarded.port}/0")
        assert (c.password, c.display) == (MARKER, f"redis://127.0.0.1:{guarded.port}/0")
        assert open_remote(c).ping()
    # A socket path keeps its "//" (redis-py refuses unix:/path) and loses the password.
    c = RemoteConfig.parse(f"unix://:{MARKER}@{tmp_path}/redis.sock?db=3&mode=ro")
    assert (c.target, c.password, c.readonly) == (f"unix://{tmp_path}/redis.sock?db=3",
                                                  MARKER, True)


def _cachectl(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    r = CliRunner().invoke(cli, list(args), env=env)
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        text += f"\n{type(r.exception).__name__}: {r.exception}"
    return r.exit_code, text


def test_cachectl_never_prints_the_password(guarded: RedisServer, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cache = str(tmp_path / "cache")
    st = open_store(cache, remote="")
    st.put(make_key({"k": 1}), {"a.bin": b"x" * 100})
    env = {"CACHECOMPILE_TRUST_REMOTE": "1"}
    dead = free_port()   # nothing listens there: every verb fails, with one error line
    cases = [*urls(guarded.port, tmp_path / "no.sock", dead), *urls(dead, tmp_path / "no.sock")]
    codes = set()
    for url in cases:
        for verb in (["remote", "ls"], ["remote", "stats"], ["push", "--cache-dir", cache],
                     ["pull", "--cache-dir", cache], ["remote", "purge", "--all", "--yes"]):
            code, text = _cachectl(*verb, "--remote", url, env=env)
            codes.add(code)
            assert leaks(text) == [], (verb, url, code, text)
            assert "Traceback" not in text, text
            # and through the variable, as a fleet sets it
            code, text = _cachectl(*verb, env={**env, "CACHECOMPILE_REMOTE": url})
            assert leaks(text) == [], (verb, url, code, text)
    assert {0, 2, 7} <= codes, codes          # worked, malformed, remote down: all seen
    assert leaks(caplog.text) == []


def test_open_store_and_a_serving_process_never_show_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from cachecompile.errors import CacheFaultWarning
    from cachecompile.warm import state

    caplog.set_level(logging.DEBUG)
    dead = free_port()
    for i, url in enumerate(urls(dead, tmp_path / "no.sock")):
        root = tmp_path / f"c{i}"
        try:
            st = open_store(root, remote=url)
        except errors.StoreError as e:
            assert leaks(str(e)) == [], (url, str(e))
        else:
            # A remote that is down: the lookup misses, the breaker warns once.
            st.get(make_key({"k": i}))
            assert leaks(repr(st) + str(st.stats())) == [], url
        # A serving process: the store is opened by cache_compile's state, and a bad URL
        # is one CacheFaultWarning, then the local cache alone.
        monkeypatch.setattr(state, "_stores", {})
        monkeypatch.setenv("CACHECOMPILE_REMOTE", url)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            st = state.store_for(str(root))  # type: ignore[assignment]
            st.get(make_key({"k": i}))
        for w in caught:
            assert leaks(str(w.message)) == [], (url, str(w.message))
            assert issubclass(w.category, CacheFaultWarning)
    assert leaks(caplog.text) == [], caplog.text


def test_the_password_from_a_variable_or_a_file(guarded: RedisServer, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://127.0.0.1:{guarded.port}/0"
    cache = str(tmp_path / "cache")
    st = open_store(cache, remote="")
    st.put(make_key({"k": 2}), {"a.bin": b"y" * 100})
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(MARKER + "\n")
    env = {"CACHECOMPILE_TRUST_REMOTE": "1", "CACHECOMPILE_REMOTE": url}
    code, text = _cachectl("push", "--cache-dir", cache,
                           env={**env, "CACHECOMPILE_REMOTE_PASSWORD": MARKER})
    assert code == 0 and "pushed 1 to" in text, text
    code, text = _cachectl("remote", "ls", "--json",
                           env={**env, "CACHECOMPILE_REMOTE_PASSWORD_FILE": str(secret_file)})
    assert code == 0 and make_key({"k": 2}).digest in text, text
    # Without it the server refuses (exit 7), and says nothing of the password.
    code, text = _cachectl("remote", "ls", env=env)
    assert code == 7 and leaks(text) == [], text
    # Given twice is ambiguous: refused, and neither is shown.
    for extra in ({"CACHECOMPILE_REMOTE_PASSWORD": MARKER,
                   "CACHECOMPILE_REMOTE_PASSWORD_FILE": str(secret_file)},
                  {"CACHECOMPILE_REMOTE": f"redis://:{MARKER}@127.0.0.1:{guarded.port}/0",
                   "CACHECOMPILE_REMOTE_PASSWORD": MARKER}):
        code, text = _cachectl("remote", "ls", env={**env, **extra})
        assert code == 2 and leaks(text) == [], text
        assert "CACHECOMPILE_REMOTE_PASSWORD" in text, text
    code, text = _cachectl("remote", "ls", env={
        **env, "CACHECOMPILE_REMOTE_PASSWORD_FILE": str(tmp_path / "missing")})
    assert code == 2 and "CACHECOMPILE_REMOTE_PASSWORD_FILE" in text, text
    # The library reads them too: a tiered store through the variable.
    monkeypatch.setenv("CACHECOMPILE_REMOTE_PASSWORD", MARKER)
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    fresh = open_store(tmp_path / "fresh", remote=url)
    assert fresh.get(make_key({"k": 2}))
    assert leaks(caplog.text) == [], caplog.text
