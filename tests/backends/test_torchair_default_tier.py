"""The Ascend path as seen from the default tier (no torch-npu installed).

The adapter itself is tested in tests_npu/ (its own venv, torchair's real Python). Here:
asking for torchair fails clearly, Inductor stays the default, and ``cachectl
import-torchair`` lists a TorchAir cache without torch.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachecompile import backends
from cachecompile.backends.torchair_machine import unavailable_reason
from cachecompile.cli.main import cli

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(unavailable_reason() is None,
                                reason="torchair imports here; tests_npu/ covers it")


class CompilerConfig:
    """Looks like torchair's CompilerConfig by name and module (torchair is absent)."""


CompilerConfig.__module__ = "torchair.configs.compiler_config"


def test_backend_torchair_errors_clearly_without_torch_npu() -> None:
    with pytest.raises(ValueError, match=r"not usable here: import torch_npu failed.*torchair"):
        backends.resolve("torchair", None)


@pytest.mark.parametrize("backend,config,ge_cache", [
    (None, None, True),
    (None, CompilerConfig(), False),
    (functools.partial(print, compiler_config=None), None, False),
])
def test_every_torchair_spelling_errors_clearly(backend: object, config: object,
                                                ge_cache: bool) -> None:
    with pytest.raises(ValueError, match="torchair backend was selected"):
        backends.resolve(backend, config, ge_cache=ge_cache)


def test_inductor_stays_the_default_and_ge_cache_is_refused_for_it() -> None:
    assert backends.resolve(None, None)[0].name == "inductor"
    with pytest.raises(ValueError, match="ge_cache=True is an option of the Ascend"):
        backends.resolve("inductor", None, ge_cache=True)


def test_cache_compile_reports_the_missing_backend() -> None:
    import torch

    from cachecompile import cache_compile
    from cachecompile.errors import ContractError

    class M(torch.nn.Module):
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    with pytest.raises(ContractError, match="torch_npu"):
        cache_compile(M().f, backend="torchair")


def _torchair_layout(root: Path) -> None:
    """A synthetic .torchair_cache as TorchAir's get_cache_bin lays it out."""
    md5 = "0123456789abcdef0123456789abcdef"
    paths = [
        (f"Decoder_dynamic_{md5}/forward", 100),
        (f"Decoder_static_gecache_{md5}/world2global_rank1_tp_rank1/decode", 300),
        (f"Decoder_static_aclgraphcache_{md5}/tp_rank0_pp_rank1/prefill", 50),
    ]
    for rel, size in paths:
        d = root / rel
        d.mkdir(parents=True)
        (d / "compiled_module").write_bytes(b"\x80" * size)
    ge = root / f"Decoder_static_gecache_{md5}/world2global_rank1_tp_rank1/decode"
    (ge / "graph_1.om").write_bytes(b"o" * 1000)
    (ge / "graph_1.idx").write_bytes(b"i" * 24)
    (root / "junk").mkdir()
    (root / "junk" / "compiled_module").write_bytes(b"x")


def test_import_torchair_lists_a_torchair_cache(tmp_path: Path) -> None:
    _torchair_layout(tmp_path)
    res = CliRunner().invoke(cli, ["import-torchair", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    by_fn = {r["function"]: r for r in rows}
    assert set(by_fn) == {"forward", "decode", "prefill"}
    d = by_fn["decode"]
    assert (d["model"], d["mode"], d["ge_cache"], d["world_size"], d["global_rank"],
            d["tp_rank"], d["pp_rank"]) == ("Decoder", "static", True, 2, 1, 1, None)
    assert d["size"] == 1324 and d["ge_files"] == 2
    p = by_fn["prefill"]
    assert (p["aclgraph"], p["tp_rank"], p["pp_rank"], p["global_rank"]) == (True, 0, 1, None)
    f = by_fn["forward"]
    assert (f["mode"], f["tp_rank"], f["md5"]) == ("dynamic", None, "0123456789abcdef" * 2)
    assert "not in TorchAir's layout" in res.output


def test_import_torchair_table_as_a_user_runs_it_without_torch(tmp_path: Path) -> None:
    _torchair_layout(tmp_path)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from cachecompile.cli.main import main\n"
            f"main(['import-torchair', {str(tmp_path)!r}])")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["model", "mode", "md5", "ranks", "function"]
    assert any("static+ge" in ln and "g1/2 tp1" in ln and "decode" in ln for ln in lines)
    assert "3 TorchAir entries" in lines[-1] and "not imported" in lines[-1]
