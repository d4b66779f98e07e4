"""TorchAir drop-in gaps: unknown keywords, ValueError, its cache dir, a readable program."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny import Small

from cachecompile import IgnoredArgumentWarning, backends, cache_compile, store
from cachecompile.backends.base import capability
from cachecompile.backends.torchair import ADAPTER as TORCHAIR
from cachecompile.cli.main import cli


def test_unknown_keywords_warn_once_naming_them(tmp_path: Path) -> None:
    m = Small()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache_compile(m.run, backend="aot_eager", cache_dir=tmp_path, zz_future_opt=1,  # type: ignore[call-overload]
                      zz_other=True)
        cache_compile(m.run, backend="aot_eager", cache_dir=tmp_path, zz_future_opt=2)  # type: ignore[call-overload]
        cache_compile(m.run, backend="aot_eager", cache_dir=tmp_path, zz_future_opt=2,  # type: ignore[call-overload]
                      zz_third=3)
    ignored = [str(w.message) for w in caught if issubclass(w.category, IgnoredArgumentWarning)]
    assert ignored == ["cache_compile() ignores unknown keyword arguments: zz_future_opt, zz_other",
                       "cache_compile() ignores unknown keyword arguments: zz_third"]
    # The warning points at the caller.
    assert all(w.filename == __file__ for w in caught
               if issubclass(w.category, IgnoredArgumentWarning))


def test_non_method_is_a_value_error_too() -> None:
    # (A lambda is a form of its own since issue 34; an int is still nothing to cache.)
    with pytest.raises(ValueError, match="bound method"):
        cache_compile(42)  # type: ignore[call-overload]


def test_torchair_default_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The adapter's capability (cache_compile asks it when no cache_dir is given).
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CACHECOMPILE_DIR", raising=False)
    monkeypatch.delenv("TORCHAIR_CACHE_HOME", raising=False)
    assert TORCHAIR.default_cache_dir() == str(tmp_path / ".torchair_cache")
    monkeypatch.setenv("TORCHAIR_CACHE_HOME", str(tmp_path / "ta"))
    assert TORCHAIR.default_cache_dir() == str(tmp_path / "ta")
    # cachecompile's own variable, when set, still wins.
    monkeypatch.setenv("CACHECOMPILE_DIR", str(tmp_path / "cc"))
    assert TORCHAIR.default_cache_dir() is None
    # Every other backend keeps cachecompile's default: the protocol's, None.
    for name in ("inductor", "aot_eager"):
        assert capability(backends.get(name), "default_cache_dir")() is None


def test_cachectl_program_prints_guards_bytecode_and_program(tmp_path: Path) -> None:
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=tmp_path)
    cached(torch.randn(3, 4))
    (info,) = [i for i in store.open_store(tmp_path).entries() if i.labels.get("function") == "run"]
    r = CliRunner().invoke(cli, ["program", "--cache-dir", str(tmp_path), info.key[:10]])
    assert r.exit_code == 0, r.output
    out = r.output
    assert f"entry     {info.key}" in out
    assert "method    Small.run" in out
    assert "# ---- guards (" in out and "x is a float32[" in out
    assert "Dynamo's transformed bytecode" in out and "LOAD_FAST" in out
    assert "# ---- program.py" in out and "torch.ops.aten.tanh.default" in out
    r = CliRunner().invoke(cli, ["program", "--cache-dir", str(tmp_path), "--no-bytecode",
                                 info.key])
    assert r.exit_code == 0 and "LOAD_FAST" not in r.output
    r = CliRunner().invoke(cli, ["program", "--cache-dir", str(tmp_path), "ffff"])
    assert r.exit_code == 2


def test_cachectl_stays_torch_free_with_the_new_verbs(child_env: dict[str, str]) -> None:
    import subprocess
    import sys

    code = ("import sys, cachecompile.cli.main as c\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'cachecompile.build' not in sys.modules\n"
            "assert {'build', 'program'} <= set(c.cli.commands)")
    p = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                       text=True, cwd=os.getcwd())
    assert p.returncode == 0, p.stderr
