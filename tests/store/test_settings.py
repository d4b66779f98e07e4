"""One table of settings (issue 51): every ``CACHECOMPILE_*`` variable is in
``cachecompile/store/settings.py`` and read through it; one truthiness rule; a bad value
warns once naming the variable and the default is used; the docs' tables are made from
the table. Torch-free, in-process."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from cachecompile.store import Hit, errors, make_key, open_store, settings
from cachecompile.store.config import parse_bool

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(REPO / "cachecompile").rglob("*.py"), *(REPO / "store").rglob("*.py")])
NAME = re.compile(r"\bCACHECOMPILE_[A-Z0-9_]*[A-Z0-9]\b")
# An environment read with a variable's literal name: os.environ.get("CACHECOMPILE_X"),
# os.getenv, env.get(...), "X" in os.environ, the old env_int/env_float/env_flag helpers,
# click's envvar="CACHECOMPILE_X".
READ = re.compile(r"""(environ\b|getenv\(|env\.get\(|env_(int|float|flag)\(|envvar\s*=)"""
                  r"""[^\n]*["']CACHECOMPILE_|["']CACHECOMPILE_\w+["']\s+(not\s+)?in\s+[\w.]*env""")


def test_every_variable_the_code_names_is_in_the_table() -> None:
    names = {s.name for s in settings.table()}
    assert len(names) == len(list(settings.table())), "one row per variable"
    named: dict[str, set[str]] = {}
    for path in SOURCES:
        for n in NAME.findall(path.read_text()):
            named.setdefault(n, set()).add(str(path.relative_to(REPO)))
    unknown = {n: sorted(where) for n, where in named.items() if n not in names}
    assert not unknown, f"variables named in the code but not in store/settings.py: {unknown}"


def test_no_module_reads_a_variable_around_the_table() -> None:
    found = []
    for path in SOURCES:
        if path.name == "settings.py" and path.parent.name == "store":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if READ.search(line):
                found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "read these through cachecompile.store.settings:\n" + "\n".join(found)


def test_a_misspelt_name_warns_once_with_the_name_it_likely_meant(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_DISABLED", "1")          # CACHECOMPILE_DISABLE
    monkeypatch.setenv("CACHECOMPILE_NOTHING_LIKE_IT", "1")
    monkeypatch.setenv("CACHECOMPILE_TEST_ANYTHING", "1")     # the project's own tests'
    monkeypatch.setenv("CACHECOMPILE_GUARD_SWEEP", "3")       # CI's
    assert settings.unknown_names() == [("CACHECOMPILE_DISABLED", "CACHECOMPILE_DISABLE"),
                                        ("CACHECOMPILE_NOTHING_LIKE_IT", None)]
    monkeypatch.setattr(settings, "_checked_names", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings.warn_unknown_names()
        settings.warn_unknown_names()      # once per process
    texts = [str(w.message) for w in caught if w.category is errors.SettingWarning]
    assert len(texts) == 2 and "did you mean CACHECOMPILE_DISABLE?" in texts[0], texts


def test_the_grep_finds_each_spelling() -> None:
    for line in ('x = os.environ.get("CACHECOMPILE_X")', "os.getenv('CACHECOMPILE_X')",
                 'env.get("CACHECOMPILE_X") or ""', 'env_int("CACHECOMPILE_X", lenient=True)',
                 'envvar="CACHECOMPILE_X",', 'if "CACHECOMPILE_X" in os.environ:'):
        assert READ.search(line), line
    assert not READ.search('raise X("set CACHECOMPILE_X=1 to trust it")')


@pytest.mark.parametrize("text", ["1", "true", "True", "TRUE", "yes", "on", "ON", " On "])
def test_switches_on(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_bool(text) is True
    monkeypatch.setenv("CACHECOMPILE_DISABLE", text)
    assert settings.DISABLE.get() is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "off", "OFF", ""])
def test_switches_off(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_bool(text) is False
    monkeypatch.setenv("CACHECOMPILE_READONLY", text)
    assert settings.READONLY.get() is False
    monkeypatch.setenv("CACHECOMPILE_SHARED_GROUP", text)
    assert settings.SHARED_GROUP.get() is False  # set, even empty: refused, not detected
    monkeypatch.delenv("CACHECOMPILE_SHARED_GROUP")
    assert settings.SHARED_GROUP.get() is None


@pytest.mark.parametrize(("setting", "bad", "expected"), [
    (settings.DISABLE, "maybe", "not a switch"),
    (settings.MAX_SIZE, "garbage", "not a size"),
    (settings.LOCK_TIMEOUT, "soon", "not a number of seconds"),
    (settings.COMPILE_SLOTS, "0", "not a whole number >= 1"),
    (settings.REMOTE_QUEUE, "many", "not a whole number"),
    (settings.GUARDS, "sometimes", "not one of always, first"),
    (settings.BUILD_LOG, "loud", "not a logging level"),
])
def test_a_bad_value_warns_once_by_name_and_the_default_is_used(
        setting: settings.Setting[object], bad: str, expected: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(setting.name, bad)
    monkeypatch.setattr(settings, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert setting.get() == setting.default
        assert setting.get() == setting.default
    (w,) = caught
    assert w.category is errors.SettingWarning
    message = str(w.message)
    assert message.startswith(f"{setting.name}={bad!r}: {expected}"), message
    assert "using the default" in message
    assert w.filename == __file__, "the warning names the line that read it"


def test_a_typo_in_the_size_cap_leaves_the_store_usable(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 51: CACHECOMPILE_MAX_SIZE=garbage made the store "unusable", nothing published.
    monkeypatch.setenv("CACHECOMPILE_MAX_SIZE", "garbage")
    monkeypatch.setattr(settings, "_warned", set())
    with pytest.warns(errors.SettingWarning, match="CACHECOMPILE_MAX_SIZE='garbage'"):
        st = open_store(tmp_path / "c")
    key = make_key({"a": 1})
    st.put(key, {"f": b"x"})
    assert isinstance(st.get(key), Hit)
    assert st.maintenance().stats()["cap"] == settings.MAX_SIZE.default


def test_a_strict_or_secret_setting() -> None:
    strict = settings.Setting("CC_TEST_STRICT", settings._positive, 1, "doc", strict=True)
    with pytest.raises(errors.StoreInputError, match="CC_TEST_STRICT='x': not a whole number"):
        strict.get({"CC_TEST_STRICT": "x"})
    secret = settings.Setting("CC_TEST_SECRET", settings._positive, 1, "doc", secret=True)
    with pytest.warns(errors.SettingWarning) as caught:
        assert secret.get({"CC_TEST_SECRET": "hunter2"}) == 1
    assert "hunter2" not in str(caught[0].message)
    assert "CC_TEST_SECRET(the value is secret)" in str(caught[0].message)


@pytest.mark.parametrize(("doc", "readme"), list(settings.DOCS.items()))
def test_the_docs_tables_are_made_from_the_table(doc: str, readme: bool) -> None:
    text = (REPO / doc).read_text()
    assert settings.replaced(text, readme) == text, (
        f"{doc}'s table of variables differs from store/settings.py: run "
        "python tools/settings_docs.py --write")
    listed = set(NAME.findall(text[text.index(settings.BEGIN):text.index(settings.END)]))
    assert listed == {s.name for s in settings.table() if s.readme or not readme}
