"""The torchair adapter against torchair's REAL Python (config, passes, converters, codegen).

Only torchair's four native modules are stood in (npu_standins.py); the stand-in GE
executor interprets the GE IR torchair produced, so outputs are checked against eager.
Every cross-process claim runs in fresh child processes.
"""

from __future__ import annotations

import importlib.metadata
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from npu_util import NpuSandbox, run_model

pytestmark = pytest.mark.standin


@pytest.fixture
def sb(tmp_path: Path) -> NpuSandbox:
    return NpuSandbox(tmp_path)


def _entries(store: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for m in sorted(store.glob("v1/entries/*/*/manifest.json")):
        man = json.loads(m.read_text())
        out[man["key"]] = man
    return out


def _method_entries(store: Path) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in _entries(store).items() if "bytecode.bin" in v["files"]}


def _program_entries(store: Path) -> list[dict[str, Any]]:
    """Entries holding torchair's generated program (method or shared-graph entries)."""
    return [v for v in _entries(store).values() if "torchair_program.py" in v["files"]]


# -- selection ----------------------------------------------------------------------------
def test_resolve_selects_torchair_for_each_spelling() -> None:
    import torchair

    from cachecompile import backends

    cfg = torchair.CompilerConfig()
    npu_backend = torchair.get_npu_backend(compiler_config=cfg)
    for backend, config, ge in (("torchair", None, False), (None, cfg, False), (None, None, True),
                                (npu_backend, None, False), (npu_backend, cfg, True)):
        adapter, options = backends.resolve(backend, config, ge_cache=ge)
        assert adapter.name == "torchair"
        assert options["ge_cache"] is ge
    # No NPU, nothing asking for torchair: Inductor stays the default.
    assert backends.resolve(None, None)[0].name == "inductor"


def test_resolve_checks_backend_against_config_like_torchair() -> None:
    import torchair

    from cachecompile import backends

    a, b = torchair.CompilerConfig(), torchair.CompilerConfig()
    b.ge_config.oo_level = "O1"
    with pytest.raises(ValueError, match="different from the config"):
        backends.resolve(torchair.get_npu_backend(compiler_config=a), b)
    with pytest.raises(TypeError, match="CompilerConfig"):
        backends.resolve("torchair", {"mode": "max-autotune"})
    with pytest.raises(ValueError, match="not of 'inductor'"):
        backends.resolve("inductor", None, ge_cache=True)


# -- key factors --------------------------------------------------------------------------
def _alternatives(opt: Any) -> list[Any]:
    optional = getattr(opt, "_OptionValue__optional", None)
    if optional:
        return [v for v in optional if v != opt._value]
    if isinstance(opt._value, bool):
        return [not opt._value]
    return []


def _option_objects(cfg: Any, prefix: str = "") -> list[tuple[str, Any]]:
    from torchair.configs._option_base import OptionValue

    out: list[tuple[str, Any]] = []
    for k, v in sorted(vars(cfg).items()):
        if k.startswith("_"):
            continue
        if isinstance(v, OptionValue):
            out.append((prefix + k, v))
        elif hasattr(v, "__dict__") and not callable(v):
            out.extend(_option_objects(v, f"{prefix}{k}."))
    return out


def test_every_config_option_is_a_key_factor_and_defaults_are_stable() -> None:
    import torchair

    from cachecompile.backends.torchair_config import ConfigOptions
    from cachecompile.key.factors import canonical

    base = canonical(dict(ConfigOptions(torchair.CompilerConfig())))
    assert base == canonical(dict(ConfigOptions(torchair.CompilerConfig())))
    assert "0x" not in json.dumps(base), "an object address leaked into the key"
    changed = 0
    for path, _ in _option_objects(torchair.CompilerConfig()):
        probe = torchair.CompilerConfig()
        opt = dict(_option_objects(probe))[path]
        for alt in _alternatives(opt):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt.value = alt
            except Exception:  # an option that refuses this value
                continue
            now = canonical(dict(ConfigOptions(probe)))
            diff = sorted(k for k in set(now) | set(base) if now.get(k) != base.get(k))
            assert diff == [path], f"setting {path}={alt!r} changed {diff}"
            changed += 1
            break
    assert changed >= 25, f"only {changed} options were probed"


def test_custom_passes_are_keyed_by_their_code() -> None:
    import torchair

    from cachecompile.backends.torchair_config import ConfigOptions

    def pass_a(gm: Any) -> None:
        return None

    def pass_b(gm: Any) -> None:
        gm.recompile()

    def opts(fn: Any) -> dict[str, Any]:
        cfg = torchair.CompilerConfig()
        cfg.post_grad_custom_pre_pass = fn
        return dict(ConfigOptions(cfg))

    assert opts(pass_a) == opts(pass_a)
    assert opts(pass_a)["post_grad_custom_pre_pass"] != opts(pass_b)["post_grad_custom_pre_pass"]


def test_default_config_key_is_the_same_in_another_process(sb: NpuSandbox) -> None:
    import torchair

    from cachecompile.backends.torchair_config import ConfigOptions
    from cachecompile.key.factors import canonical

    here = canonical(dict(ConfigOptions(torchair.CompilerConfig())))
    there = sb.run("""
        import torchair
        from cachecompile.backends.torchair_config import ConfigOptions
        from cachecompile.key.factors import canonical
        report(canonical(dict(ConfigOptions(torchair.CompilerConfig()))))
    """)
    assert there.value == here


def test_machine_factors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import npu_standins
    import torchair

    from cachecompile.backends import torchair as adapter_mod
    from cachecompile.backends.torchair_config import make_options

    opts = make_options(torchair.CompilerConfig(), True)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    f = adapter_mod.ADAPTER.factors(opts)
    assert f["cann"] is None and f["torch_npu_imported"] is False
    assert f["soc"] == npu_standins.STANDIN_SOC
    assert f["torch_npu"] == importlib.metadata.version("torch-npu")
    assert f["torchair"]["files"] > 100 and f["ge_cache"] is True
    assert f["npu"]["deterministic_level"] is None
    (tmp_path / "version.info").write_text("Version=8.3.RC1\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    assert adapter_mod.ADAPTER.factors(opts)["cann"] == "8.3.RC1"


# -- round trips in fresh processes -------------------------------------------------------
@pytest.mark.parametrize("ge_cache", [False, True])
def test_round_trip_in_fresh_processes(sb: NpuSandbox, ge_cache: bool) -> None:
    cc = {"backend": "torchair", "ge_cache": ge_cache}
    cold = run_model(sb, cc)
    assert cold["ok"] and cold["events"] == [["miss", "float32[n,n]@cpu"]]
    assert cold["dynamo_compiles"] >= 1
    warm = run_model(sb, cc)
    assert warm["ok"], "the replayed GE program disagrees with eager"
    assert warm["events"] == [["hit", "float32[n,n]@cpu"]]
    assert warm["dynamo_compiles"] == 0, "a hit must not run Dynamo"
    if ge_cache:
        # GE loaded the graph from the .om in the entry: no GE compile in this process.
        assert warm["ge"]["compile"] == 0 and warm["ge"]["cache_load"] == 1
    else:
        assert warm["ge"]["compile"] == 1 and warm["ge"]["cache_load"] == 0


def test_ge_cache_files_are_staged_published_and_never_written_on_a_hit(sb: NpuSandbox) -> None:
    cc = {"backend": "torchair", "ge_cache": True}
    run_model(sb, cc)
    progs = _program_entries(sb.store)
    assert progs
    for man in progs:
        names = sorted(man["files"])
        assert any(n.startswith("ge_cache/") and n.endswith(".om") for n in names), names
        assert any(n.startswith("ge_cache/") and n.endswith(".idx") for n in names), names
        assert man["meta"]["program"]["staged_files"] == [n for n in names
                                                          if n.startswith("ge_cache/")]
    before = {p: p.read_bytes() for p in sb.store.glob("v1/entries/*/*/data/**/*") if p.is_file()}
    run_model(sb, cc)
    after = {p: p.read_bytes() for p in sb.store.glob("v1/entries/*/*/data/**/*") if p.is_file()}
    assert before == after
    from click.testing import CliRunner

    from cachecompile.cli.main import cli

    res = CliRunner().invoke(cli, ["verify", "--cache-dir", str(sb.store)])
    assert res.exit_code == 0, res.output


def test_without_ge_cache_no_ge_files(sb: NpuSandbox) -> None:
    run_model(sb, {"backend": "torchair"})
    for man in _program_entries(sb.store):
        assert not [n for n in man["files"] if n.startswith("ge_cache/")]
        assert man["meta"]["program"]["inputs"][0].startswith("L['self']")


def test_parameters_are_read_per_call_not_captured_at_load(sb: NpuSandbox) -> None:
    run_model(sb)
    after = """
    with torch.no_grad():
        m.lin.weight.mul_(-3.0)
        m.lin.bias = torch.nn.Parameter(torch.full((6,), 0.5))
        got, want = m.cached(x), m._forward(x)
    extra = {"swap_ok": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))}
    """
    warm = run_model(sb, after=after)
    assert warm["events"][0][0] == "hit" and warm["swap_ok"]


# -- what TorchAir gets wrong -------------------------------------------------------------
def test_stale_hits_after_code_config_cann_or_env_changes(sb: NpuSandbox, tmp_path: Path) -> None:
    assert run_model(sb)["events"][0][0] == "miss"
    assert run_model(sb)["events"][0][0] == "hit"
    cfg_setup = """
    import torchair
    cfg = torchair.CompilerConfig()
    cfg.experimental_config.frozen_parameter = True
    cc["config"] = cfg
    """
    assert run_model(sb, setup=cfg_setup)["events"][0][0] == "miss"
    cann = tmp_path / "cann"
    cann.mkdir()
    (cann / "version.info").write_text("Version=8.2.RC1\n")
    assert run_model(sb, ASCEND_HOME_PATH=str(cann))["events"][0][0] == "miss"
    (cann / "version.info").write_text("Version=8.3.RC1\n")
    assert run_model(sb, ASCEND_HOME_PATH=str(cann))["events"][0][0] == "miss"
    assert run_model(sb, AUTOFUSE_FLAGS="--enable_autofuse=true")["events"][0][0] == "miss"
    # The method's source changes (TorchAir's key, module repr + config, would not see it).
    model = sb.root / "npu_model.py"
    model.write_text(model.read_text().replace("* GLOBAL_SCALE", "* GLOBAL_SCALE * 0.5"))
    r = run_model(sb)
    assert r["events"][0][0] == "miss" and r["ok"]


def test_a_torn_ge_file_is_a_miss_for_that_entry_only(sb: NpuSandbox) -> None:
    run_model(sb, {"backend": "torchair", "ge_cache": True})
    run_model(sb, {"backend": "torchair", "ge_cache": True, "tp_rank": 1})
    entries = _method_entries(sb.store)
    assert len(entries) == 2
    victim = next(p for p in sb.store.glob("v1/blobs/*/*")
                  if p.read_bytes().startswith(b"CACHECOMPILE-STANDIN-OM"))
    victim.chmod(0o600)
    victim.write_bytes(victim.read_bytes()[:40])  # a torn write
    r = run_model(sb, {"backend": "torchair", "ge_cache": True})
    assert r["ok"] and r["events"][0][0] in ("miss", "hit")
    assert "CacheFaultWarning" in r.stderr or r["events"][0][0] == "miss"
    # The other rank's entry was not touched: no "clear the whole cache dir".
    other = run_model(sb, {"backend": "torchair", "ge_cache": True, "tp_rank": 1})
    assert other["ok"]
    assert len(_method_entries(sb.store)) == 2


def test_recompile_keeps_the_entry_and_its_guards_decide(sb: NpuSandbox) -> None:
    """A global changed after the first call: with every guard on every call (the
    default) the change is a lookup in the compiling process too: the entry's guard
    names it, the new state compiles, stays right and is published as a second variant
    beside the first (which keeps its own guards). Fresh processes then hit the variant
    of their state."""
    after = """
    npu_model.SHIFT_DOWN = False
    with torch.no_grad():
        got, want = m.cached(x), m._forward(x)
    extra = {"recompiled_ok": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))}
    """
    log = "import logging; logging.basicConfig(level=logging.INFO)\n"
    r = run_model(sb, setup=log, after=after)
    assert r["recompiled_ok"]
    assert "guard failed: npu_model.SHIFT_DOWN" in r.stderr, r.stderr[-3000:]
    assert len(_method_entries(sb.store)) == 2, "each state its own variant"
    flipped = "npu_model.SHIFT_DOWN = False"
    changed = run_model(sb, setup=flipped)
    assert changed["ok"] and changed["events"][0][0] == "hit", changed.value
    assert len(_method_entries(sb.store)) == 2
    assert run_model(sb)["events"][0][0] == "hit"


def test_rank_layout_each_rank_its_own_entry(sb: NpuSandbox) -> None:
    for tp in (0, 1):
        assert run_model(sb, {"backend": "torchair", "tp_rank": tp, "pp_rank": 0})["ok"]
    labels = sorted((m["labels"]["tp_rank"], m["labels"]["pp_rank"], m["labels"]["backend"])
                    for m in _method_entries(sb.store).values())
    assert labels == [("0", "0", "torchair"), ("1", "0", "torchair")]
    for tp in (0, 1):
        r = run_model(sb, {"backend": "torchair", "tp_rank": tp, "pp_rank": 0})
        assert r["events"][0][0] == "hit"


GEARED_CALL = """
from torchair.inference import set_dim_gears
xg = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
set_dim_gears(xg, {0: %s})
with torch.no_grad():
    try:
        got = m.cached(xg)
        want = m._forward(xg)
        extra = {"gear": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))}
    except Exception as e:
        extra = {"gear": type(e).__name__}
"""


def test_gears_are_part_of_the_signature_never_a_wrong_graph(sb: NpuSandbox) -> None:
    """A GE program is built for its inputs' gears: a call whose inputs carry other gears
    (set_dim_gears) is another signature, compiled for those gears, never the old graph."""
    run_model(sb)  # the program, built without gears
    r = run_model(sb, after=GEARED_CALL % "[2, 4]")
    assert r["events"][0][0] == "hit"
    assert r["events"][1][0] == "miss" and "gears" in r["events"][1][1], r["events"]
    assert r["gear"] is True
    again = run_model(sb, after=GEARED_CALL % "[2, 4]")  # a fresh process: both hit
    assert [e[0] for e in again["events"]] == ["hit", "hit"] and again["gear"] is True
    other = run_model(sb, after=GEARED_CALL % "[4, 8]")  # other gears: a miss of its own
    assert [e[0] for e in other["events"]] == ["hit", "miss"] and other["gear"] is True


def test_default_cache_dir_is_torchairs(sb: NpuSandbox) -> None:
    """With the torchair adapter and no cache_dir (and no $CACHECOMPILE_DIR), entries go
    where TorchAir's would: $TORCHAIR_CACHE_HOME, else ./.torchair_cache."""
    home = sb.root / "torchair-home"
    r = run_model(sb, CACHECOMPILE_DIR="", TORCHAIR_CACHE_HOME=str(home))
    assert r["ok"]
    assert _method_entries(home), "no entry under $TORCHAIR_CACHE_HOME"
    assert not _method_entries(sb.store)
    r = run_model(sb, CACHECOMPILE_DIR="", TORCHAIR_CACHE_HOME="")
    assert r["ok"]
    assert _method_entries(sb.root / ".torchair_cache"), "no entry under ./.torchair_cache"
    # A second process finds it there.
    again = run_model(sb, CACHECOMPILE_DIR="", TORCHAIR_CACHE_HOME="")
    assert again["events"][0][0] == "hit"


def test_unknown_keywords_are_ignored_like_torchair(sb: NpuSandbox) -> None:
    r = run_model(sb, {"backend": "torchair", "zz_torchair_only_option": 1})
    assert r["ok"]
    assert "IgnoredArgumentWarning" in r.stderr and "zz_torchair_only_option" in r.stderr


# -- real hardware ------------------------------------------------------------------------
@pytest.mark.npu
def test_npu_round_trip_on_hardware(sb: NpuSandbox) -> None:
    """On an Ascend machine: cold compile on the NPU, warm hit with GE's cache."""
    setup = """
    import torch_npu  # noqa: F401
    torch.set_default_device("npu")
    """
    cc = {"backend": "torchair", "ge_cache": True}
    cold = run_model(sb, cc, setup=setup, NPU_TIER_REAL="1")
    warm = run_model(sb, cc, setup=setup, NPU_TIER_REAL="1")
    assert cold["ok"] and warm["ok"] and warm["events"][0][0] == "hit"
    assert warm["dynamo_compiles"] == 0


@pytest.mark.npu
def test_npu_static_kernels_on_hardware(sb: NpuSandbox) -> None:
    """Static kernels build .run packages in the staging dir; they must be entry files."""
    setup = """
    import torch_npu  # noqa: F401
    import torchair
    torch.set_default_device("npu")
    cfg = torchair.CompilerConfig()
    cfg.mode = "npugraph_ex"
    cfg.experimental_config.aclgraph._aclnn_static_shape_kernel = True
    cc["config"] = cfg
    """
    run_model(sb, {"backend": "torchair", "dynamic": False}, setup=setup, NPU_TIER_REAL="1")
    files = [n for m in _program_entries(sb.store) for n in m["files"]]
    assert any(n.startswith("static_kernel/") for n in files), files
