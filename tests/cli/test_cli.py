"""``cachectl`` driven as a user drives it: its arguments, output, exit code and environment.

The verbs run in this process through click's runner (the same group, the same error to
exit-code mapping as the installed command, without a Python start per call);
``test_the_installed_command_runs`` proves the entry point itself in a subprocess. A bug
in a verb raises here with its traceback (``catch_exceptions=False``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ccutil
import pytest
from ccutil import Ran

from cachecompile.store import Store, fsutil, make_key, open_store, verification


@pytest.fixture
def cache(tmp_path: Path) -> Store:
    st = open_store(tmp_path / "cache")
    assert isinstance(st, Store)
    st.put(make_key({"model": "llama", "fn": "forward", "dtype": "float16", "bs": 1}),
           {"kernel.so": b"\x7fELF" * 100, "code.py": b"x=1"},
           labels={"model": "llama", "function": "forward", "ranks": "0"})
    st.put(make_key({"model": "llama", "fn": "forward", "dtype": "bfloat16", "bs": 1}),
           {"kernel.so": b"\x7fELF" * 200}, labels={"model": "llama", "function": "forward"})
    st.put(make_key({"model": "mlp", "fn": "forward"}), {"a": b"a"},
           labels={"model": "mlp", "function": "forward"})
    return st


def cachectl(child_env: dict[str, str], *args: str, input: str | None = None) -> Ran:
    """cachectl ARGS with exactly ``child_env`` as its environment, in this process."""
    return ccutil.cachectl(*args, env=child_env, input=input)


def test_the_installed_command_runs(cache: Store, child_env: dict[str, str]) -> None:
    """The entry point a user types, in a fresh process: output and exit codes as above."""
    cmd = [sys.executable, "-m", "cachecompile.cli.main"]
    p = subprocess.run([*cmd, "ls", "--cache-dir", str(cache.root), "--json"], env=child_env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and len(json.loads(p.stdout)) == 3, p.stderr
    p = subprocess.run([*cmd, "show", "ffffffffffff", "--cache-dir", str(cache.root)],
                       env=child_env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no entry matches" in p.stderr and "Traceback" not in p.stderr


def test_a_reader_that_goes_away_is_no_error(cache: Store, child_env: dict[str, str]) -> None:
    """`cachectl ls | head -1` under `set -o pipefail`: the reader closes the pipe before
    cachectl writes; cachectl exits 0 and says nothing (it printed `Error: Broken pipe` and
    exited 7, or rich exited 1)."""
    cmd = [sys.executable, "-m", "cachecompile.cli.main"]
    for verb in (["ls"], ["ls", "--json"], ["stats"]):
        r, w = os.pipe()
        os.close(r)     # the reader is gone before the first write
        try:
            p = subprocess.run([*cmd, *verb, "--cache-dir", str(cache.root)], env=child_env,
                               stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
        finally:
            os.close(w)
        assert p.returncode == 0 and p.stderr == "", (verb, p.returncode, p.stderr)


def _key(st: Store, **labels: str) -> str:
    (info,) = [i for i in st.entries() if all(i.labels.get(k) == v for k, v in labels.items())]
    return info.key


def test_ls_table_filters_sort_and_json(cache: Store, child_env: dict[str, str]) -> None:
    d = str(cache.root)
    p = cachectl(child_env, "ls", "--cache-dir", d)
    assert p.returncode == 0, p.stderr
    assert "llama" in p.stdout and "mlp" in p.stdout and "forward" in p.stdout
    assert len([ln for ln in p.stdout.splitlines() if "forward" in ln]) == 3
    p = cachectl(child_env, "ls", "--cache-dir", d, "--model", "mlp", "--json")
    rows = json.loads(p.stdout)
    assert [r["labels"]["model"] for r in rows] == ["mlp"]
    assert {"key", "size_bytes", "created", "last_used", "hits", "labels"} <= set(rows[0])
    p = cachectl(child_env, "ls", "--cache-dir", d, "--label", "model=llama", "--sort", "size",
                 "--json")
    assert [r["size_bytes"] for r in json.loads(p.stdout)] == [800, 403]
    p = cachectl(child_env, "ls", "--cache-dir", d, "--sort", "nope")
    assert p.returncode == 2
    # --cache-dir falls back to the environment like the library does.
    p = cachectl(dict(child_env, CACHECOMPILE_DIR=d), "ls", "--json")
    assert len(json.loads(p.stdout)) == 3


def test_ls_folds_a_signatures_variants_into_one_row(cache: Store,
                                                      child_env: dict[str, str]) -> None:
    """A resume frame specialised on a value read after a break publishes a variant per
    value (issue 61: 8 rows for one signature): one row says how many, --variants lists
    each, --json every entry."""
    sig = {"model": "moe", "function": "forward", "signature": "float32[2,4]@cpu",
           "signature_key": "ab" * 16}
    cache.put(make_key({"sig": 1, "variant": 0}), {"f": b"x" * 10},
              labels={**sig, "variant": "0", "frames": "2"})
    cache.put(make_key({"sig": 1, "variant": 1}), {"f": b"x" * 20},
              labels={**sig, "variant": "1", "frames": "2"})
    for v in range(5):
        cache.put(make_key({"sig": 1, "frame": v}), {"f": b"y" * 100},
                  labels={**sig, "dynamo_frame": "M.resume_at_7", "frames": "+1"})
    d = str(cache.root)
    p = cachectl(child_env, "ls", "--cache-dir", d, "--model", "moe")
    assert p.returncode == 0, p.stderr
    (row,) = [ln for ln in p.stdout.splitlines() if "moe" in ln]
    assert row.startswith(_key(cache, variant="0")[:12]) and "7 (5 frame)" in row, p.stdout
    assert "530 B" in row  # the sizes of all seven
    assert p.stdout.rstrip().endswith("7 entries, in 1 row (--variants lists each)"), p.stdout
    p = cachectl(child_env, "ls", "--cache-dir", d, "--model", "moe", "--variants")
    assert len([ln for ln in p.stdout.splitlines() if "moe" in ln]) == 7
    p = cachectl(child_env, "ls", "--cache-dir", d, "--model", "moe", "--json")
    assert len(json.loads(p.stdout)) == 7
    # Other signatures are rows of their own; nothing said where nothing folds.
    p = cachectl(child_env, "ls", "--cache-dir", d, "--model", "llama")
    assert "--variants" not in p.stdout and len(p.stdout.splitlines()) == 4, p.stdout


def test_show_by_prefix(cache: Store, child_env: dict[str, str]) -> None:
    k = _key(cache, model="mlp")
    p = cachectl(child_env, "show", k[:8], "--cache-dir", str(cache.root))
    assert p.returncode == 0, p.stderr
    assert k in p.stdout and "factors" in p.stdout and '"mlp"' in p.stdout and "files" in p.stdout
    p = cachectl(child_env, "show", k[:8], "--json", "--cache-dir", str(cache.root))
    assert json.loads(p.stdout)["factors"] == {"model": "mlp", "fn": "forward"}


def test_unknown_and_ambiguous_keys_are_usage_errors(cache: Store, child_env: dict[str, str]) -> None:
    p = cachectl(child_env, "show", "ffffffffffff", "--cache-dir", str(cache.root))
    assert p.returncode == 2 and "no entry matches" in p.stderr and "Traceback" not in p.stderr
    for i in range(40):  # make some first hex digit ambiguous
        cache.put(make_key({"n": i}), {"a": b"x"})
    firsts = [d[0] for d in cache.digests()]
    p = cachectl(child_env, "show", max(set(firsts), key=firsts.count), "--cache-dir",
                 str(cache.root))
    assert p.returncode == 2 and "matches" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_explain_two_keys_and_nearest(cache: Store, child_env: dict[str, str]) -> None:
    rows = json.loads(cachectl(child_env, "ls", "--json", "--model", "llama", "--cache-dir",
                               str(cache.root)).stdout)
    a, b = (r["key"] for r in rows)
    p = cachectl(child_env, "explain", a[:10], b[:10], "--cache-dir", str(cache.root))
    assert p.returncode == 0, p.stderr
    assert "1 of 4 factors differ" in p.stdout and "dtype" in p.stdout
    assert "bfloat16" in p.stdout and "float16" in p.stdout
    assert "* bs" not in p.stdout  # equal factors are not listed without --all
    # One key: compared with the nearest llama/forward entry, never with the mlp one.
    p = cachectl(child_env, "explain", a, "--json", "--cache-dir", str(cache.root))
    doc = json.loads(p.stdout)
    assert doc["b"] == b and list(doc["differ"]) == ["dtype"]


def test_purge_confirm_dry_run_yes(cache: Store, child_env: dict[str, str]) -> None:
    d = str(cache.root)
    p = cachectl(child_env, "purge", "--cache-dir", d)
    assert p.returncode == 2 and "say what to purge" in p.stderr
    p = cachectl(child_env, "purge", "--model", "llama", "--dry-run", "--cache-dir", d)
    assert p.returncode == 0 and "2 entries" in p.stdout and "dry run" in p.stdout
    p = cachectl(child_env, "purge", "--model", "llama", "--cache-dir", d, input="n\n")
    assert "aborted" in p.stdout and len(list(cache.digests())) == 3
    p = cachectl(child_env, "purge", "--model", "llama", "--cache-dir", d, input="y\n")
    assert "removed 2 entries" in p.stdout and len(list(cache.digests())) == 1
    p = cachectl(child_env, "purge", "--older-than", "7d", "--yes", "--cache-dir", d)
    assert "nothing to purge" in p.stdout
    p = cachectl(child_env, "purge", "--older-than", "soon", "--yes", "--cache-dir", d)
    assert p.returncode == 2
    p = cachectl(child_env, "purge", "--all", "--yes", "--cache-dir", d)
    assert p.returncode == 0 and list(cache.digests()) == []


def test_stats_json_and_zero(cache: Store, child_env: dict[str, str]) -> None:
    d = str(cache.root)
    cache.get(make_key({"absent": 1}))
    cache.record_miss("absent")  # the caller counts what its lookup came to
    cache.get(_key(cache, model="mlp"))
    s = json.loads(cachectl(child_env, "stats", "--json", "--cache-dir", d).stdout)
    assert (s["entries"], s["hits"], s["misses"], s["publishes"]) == (3, 1, {"absent": 1}, 3)
    assert s["cap"] == 10 * 1024**3 and s["bytes"] == 1204
    p = cachectl(child_env, "stats", "--cache-dir", d)
    assert p.returncode == 0 and "entries" in p.stdout and "absent" in p.stdout
    s = json.loads(cachectl(child_env, "stats", "--zero", "--json", "--cache-dir", d).stdout)
    assert (s["hits"], s["misses"], s["entries"]) == (0, {}, 3)


def test_stats_show_frames_compiled_live_apart_from_the_hit_rate(
        cache: Store, child_env: dict[str, str]) -> None:
    """Two hits whose graph breaks compiled a frame live: 100% hits, the frames apart
    (they read as a 50% hit rate, as if each hit had been a miss too)."""
    d = str(cache.root)
    for _ in range(2):
        cache.get(_key(cache, model="mlp"))
        cache.record_miss("frame", "Net.torch_dynamo_resume_in_forward_at_12: compiled")
    p = cachectl(child_env, "stats", "--cache-dir", d)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.strip()}
    assert "(100.0%)" in rows["hits"] and rows["misses"].split()[1] == "0", p.stdout
    assert "frames compiled live" in p.stdout and "resume_in_forward_at_12" in p.stdout


def test_gc_with_max_size(cache: Store, child_env: dict[str, str]) -> None:
    p = cachectl(child_env, "gc", "--max-size", "1K", "--cache-dir", str(cache.root))
    assert p.returncode == 0, p.stderr
    assert "evicted" in p.stdout and sum(i.size_bytes for i in cache.entries()) <= 1024
    p = cachectl(child_env, "gc", "--max-size", "lots", "--cache-dir", str(cache.root))
    assert p.returncode == 2 and "not a size" in p.stderr


def test_verify_reports_and_fixes(cache: Store, child_env: dict[str, str]) -> None:
    d = str(cache.root)
    p = cachectl(child_env, "verify", "--cache-dir", d)
    assert p.returncode == 0 and "checked 3 entries: ok" in p.stdout
    k = _key(cache, model="mlp")
    f = cache.entry_dir(k) / "data" / "a"
    f.chmod(0o600)
    f.write_bytes(b"b")
    p = cachectl(child_env, "verify", "--cache-dir", d)
    assert p.returncode == 1 and k in p.stdout and "checksum" in p.stdout
    p = cachectl(child_env, "verify", "--fix", "--cache-dir", d)
    assert p.returncode == 1 and "quarantined" in p.stdout
    p = cachectl(child_env, "verify", "--cache-dir", d)
    assert p.returncode == 0 and "checked 2 entries: ok" in p.stdout
    verification._VERIFIED.clear()


def test_insecure_store_exit_code(tmp_path: Path, child_env: dict[str, str]) -> None:
    root = tmp_path / "foreign"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    p = cachectl(child_env, "ls", "--cache-dir", str(root))
    assert p.returncode == 3
    assert "CACHECOMPILE_SHARED_GROUP" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_lock_timeout_exit_code_is_documented() -> None:
    from cachecompile.cli import common
    from cachecompile.store import errors

    assert common.EXIT_LOCK == 4
    assert next(c for t, c in common.ERROR_CODES
                if isinstance(errors.LockTimeout("/x", 1), t)) == 4


def test_help_lists_every_verb(child_env: dict[str, str]) -> None:
    p = cachectl(child_env, "--help")
    assert p.returncode == 0
    for verb in ("ls", "show", "explain", "purge", "stats", "gc", "verify"):
        assert verb in p.stdout


def test_large_listing_is_plain_aligned_text() -> None:
    from cachecompile.cli.common import RICH_MAX_ROWS, _plain_table
    from cachecompile.store import EntryInfo

    infos = [EntryInfo(key=f"{i:032x}", size_bytes=i, created=0.0, last_used=0.0, hits=i,
                       labels={"model": "m", "function": "f"}) for i in range(RICH_MAX_ROWS + 1)]
    lines = _plain_table(infos).splitlines()
    assert len(lines) == RICH_MAX_ROWS + 2 and lines[0].split()[:3] == ["key", "model", "function"]
    assert len({ln.index(" m ") for ln in lines[1:]}) == 1  # columns line up


def test_plain_listing_is_the_rows_of_the_table() -> None:
    # The plain table is made a column at a time (issue 32: ls at 100,000 entries): each
    # line must be what the row-by-row table (the rich one's _row) makes.
    from cachecompile._version import code_label
    from cachecompile.cli.common import _COLUMNS, _plain_lines, _row, group_status
    from cachecompile.store import EntryInfo

    variants = [{"model": "m", "function": "f"}, {"ranks": "0,1", "code": code_label()},
                {"rank": "3", "group": "g" * 20, "global_rank": "3", "group_size": "4"},
                {"signature": "s" * 80, "dynamic": "1", "model": "[bold]x"}, {}]
    infos = [EntryInfo(key=f"{i * 7919:032x}", size_bytes=(i * 104729) % 3_000_000,
                       created=0.0 if i % 5 == 0 else 1.7e9 + i * 37.5,
                       last_used=1.7e9 + i * 91.0, hits=i % 13, labels=variants[i % 5],
                       state=("ok", "unindexed", "bad-manifest")[i % 3]) for i in range(60)]
    groups = group_status(infos)
    folded = {i.key: f"{n} (1 frame)" for n, i in enumerate(infos[::7], 2)}
    rows = [tuple(c for c, _ in _COLUMNS)] + [tuple(_row(i, groups, folded)) for i in infos]
    widths = [max(map(len, col)) for col in zip(*rows, strict=True)]
    fmt = "  ".join(f"{{:{'>' if just == 'right' else '<'}{w}}}"
                    for w, (_, just) in zip(widths, _COLUMNS, strict=True))
    assert list(_plain_lines(infos, groups, folded)) == [fmt.format(*r).rstrip() for r in rows]
    assert list(_plain_lines([], None)) == ["  ".join(c for c, _ in _COLUMNS)]



def test_program_shows_placeholder_constants_as_stored() -> None:
    """cachectl program's placeholder pattern is built from entry.files.CONST_PREFIX and
    matches exactly what its former literal pattern matched."""
    import marshal
    import re

    from cachecompile.cli.program import _PLACEHOLDER, disassemble
    from cachecompile.entry.files import CONST_PREFIX

    literal = re.compile(r"'\\x00cachecompile-const\\x00(\d+)'")  # the pattern before
    samples = [repr(CONST_PREFIX + "0"), repr(CONST_PREFIX + "12"),
               f"LOAD_CONST 3 ({CONST_PREFIX + '7'!r}) x {CONST_PREFIX + '8'!r}",
               repr(CONST_PREFIX), repr(CONST_PREFIX + "x1"), repr(CONST_PREFIX + "1x"),
               repr("cachecompile-const\x003"), CONST_PREFIX + "4", '"' + repr(CONST_PREFIX + "5")[1:-1] + '"']
    found = [[m.group(0, 1) for m in _PLACEHOLDER.finditer(s)] for s in samples]
    assert found == [[m.group(0, 1) for m in literal.finditer(s)] for s in samples]
    assert [g for row in found for _, g in row] == ["0", "12", "7", "8"]
    # Through dis, as the verb shows it: a stored constant in place of its placeholder,
    # a placeholder past the stored constants left as it is.
    code = compile(f"a = {CONST_PREFIX + '0'!r}\nb = {CONST_PREFIX + '5'!r}\n", "<entry>", "exec")
    text = disassemble(marshal.dumps(code), [{"dtype": "float16"}])
    assert '<{"dtype": "float16"}>' in text and repr(CONST_PREFIX + "0") not in text
    assert repr(CONST_PREFIX + "5") in text

def test_explain_names_the_guards_two_variants_differ_in(tmp_path: Path,
                                                         child_env: dict[str, str]) -> None:
    st = open_store(tmp_path / "cache")
    base = {"model": "M", "fn": "run"}
    guard = {"kind": "eq", "expr": "L['self'].cfg.act", "args": False}
    a = st.put(make_key({**base, "variant": 0}), {"p": b"1"}, labels={"model": "M"},
               meta={"guards": [{**guard, "value": "relu", "text": "self.cfg.act == 'relu'"}]})
    b = st.put(make_key({**base, "variant": 1}), {"p": b"2"}, labels={"model": "M"},
               meta={"guards": [{**guard, "value": "silu", "text": "self.cfg.act == 'silu'"}]})
    p = cachectl(child_env, "explain", "--cache-dir", str(tmp_path / "cache"), a.key[:12],
                 b.key[:12])
    assert p.returncode == 0, p.stderr
    assert "self.cfg.act == 'relu'" in p.stdout and "self.cfg.act == 'silu'" in p.stdout
    j = cachectl(child_env, "explain", "--json", "--cache-dir", str(tmp_path / "cache"),
                 a.key[:12], b.key[:12])
    assert json.loads(j.stdout)["guards"] == [["self.cfg.act == 'relu'",
                                               "self.cfg.act == 'silu'"]]


def test_explain_leads_with_values_and_folds_renamed_globals(
        tmp_path: Path, child_env: dict[str, str]) -> None:
    # As Gemma2's decode variants were: 42 guards read a global Dynamo renamed between
    # the traces (__builtins_dict___16 / ___18), one guard differs in value.
    st = open_store(tmp_path / "cache")
    base = {"model": "M", "fn": "step"}

    def guards(n: int, suffix: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"kind": "ident", "expr": f"G['__builtins_dict___{suffix}']['f{i}']",
             "value": f"builtin:f{i}", "args": False,
             "text": f"__main__.__builtins_dict___{suffix}['f{i}'] is builtin:f{i}"}
            for i in range(42)]
        out.append({"kind": "eq", "expr": "L['self'].cache.n", "value": n, "args": False,
                    "text": f"self.cache.n == {n}"})
        return out

    labels = {"model": "M", "function": "step", "signature": "int64[1,1]@cpu"}
    a = st.put(make_key({**base, "variant": 0}), {"p": b"1"}, labels=labels,
               meta={"guards": guards(14, 16)})
    b = st.put(make_key({**base, "variant": 1}), {"p": b"2"}, labels=labels,
               meta={"guards": guards(15, 18)})
    p = cachectl(child_env, "explain", "--cache-dir", str(tmp_path / "cache"), a.key[:12])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"{a.key[:12]} vs {b.key[:12]}: 0 of"), lines
    assert "1 guards differ in value" in lines[1], lines
    assert "self.cache.n == 14" in lines[3] and "self.cache.n == 15" in lines[3], lines
    assert "42 guards differ only by a global Dynamo renamed" in p.stdout
    assert "__builtins_dict___" not in p.stdout.replace("__builtins_dict___N", "")
    assert len(lines) < 10, p.stdout
    j = json.loads(cachectl(child_env, "explain", "--json", "--cache-dir",
                            str(tmp_path / "cache"), a.key[:12]).stdout)
    assert j["guards_changed"] == [["self.cache.n == 14", "self.cache.n == 15"]]
    assert j["guards_renamed"] == 42
    # One entry with no sibling: explained alone, exit 0.
    st.delete(b.key)
    p = cachectl(child_env, "explain", "--cache-dir", str(tmp_path / "cache"), a.key[:12])
    assert p.returncode == 0, p.stderr
    assert "is the only entry of M.step" in p.stdout and "self.cache.n == 14" in p.stdout
    assert "f41" not in p.stdout  # identity guards are counted, not listed
    # show: readable, guards summarised; the raw guards stay behind --json / --guards.
    p = cachectl(child_env, "show", "--cache-dir", str(tmp_path / "cache"), a.key[:12])
    assert p.returncode == 0, p.stderr
    assert "serves   M.step [int64[1,1]@cpu]" in p.stdout and "self.cache.n == 14" in p.stdout
    assert "f41" not in p.stdout and len(p.stdout) < 3000, p.stdout
    p = cachectl(child_env, "show", "--guards", "--cache-dir", str(tmp_path / "cache"),
                 a.key[:12])
    assert "f41" in p.stdout


@pytest.mark.parametrize("verb", [("ls",), ("ls", "--json"), ("verify",), ("stats",),
                                  ("stats", "--json"), ("show", "abcd"), ("explain", "abcd"),
                                  ("gc",), ("purge", "--all", "--yes")])
def test_a_missing_cache_dir_is_an_error_and_not_created(
        tmp_path: Path, child_env: dict[str, str], verb: tuple[str, ...]) -> None:
    typo = tmp_path / "cahce"
    p = cachectl(child_env, *verb, "--cache-dir", str(typo))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "no cache" in p.stderr and str(typo) in p.stderr and "Traceback" not in p.stderr
    assert not typo.exists()


def test_verify_reports_a_symlinked_fan_out_dir(cache: Store, tmp_path: Path,
                                                child_env: dict[str, str]) -> None:
    import shutil

    k = _key(cache, model="mlp")
    shard = cache.entry_dir(k).parent
    outside = tmp_path / "elsewhere"
    shutil.copytree(shard, outside)
    fsutil.rmtree_quiet(shard)
    shard.symlink_to(outside, target_is_directory=True)
    p = cachectl(child_env, "verify", "--cache-dir", str(cache.root))
    assert p.returncode == 1 and str(shard) in p.stdout and "symlink" in p.stdout, p.stdout
    rows = json.loads(cachectl(child_env, "ls", "--json", "--cache-dir", str(cache.root)).stdout)
    assert k not in {r["key"] for r in rows}
    p = cachectl(child_env, "show", k, "--cache-dir", str(cache.root))
    assert p.returncode != 0 and k not in p.stdout


def test_stats_count_what_ls_lists(tmp_path: Path, child_env: dict[str, str]) -> None:
    # A cache_compile'd method publishes its entry; with a sharing backend it also
    # publishes the graph's program as an internal entry (labels kind=graph), looked up
    # by every rank. stats must count the user's entries and lookups, as ls shows them.
    st = open_store(tmp_path / "cache")
    user = make_key({"model": "M", "fn": "forward"})
    graph = make_key({"kind": "graph", "graph": "g" * 32})
    st.put(user, {"a": b"user"}, labels={"model": "M", "function": "forward"})
    st.put(graph, {"p": b"graph"}, labels={"kind": "graph", "function": "(shared graph)"})
    st.get(user)
    st.get(graph)
    st.get(graph)
    st.get(make_key({"kind": "graph", "graph": "h" * 32}))  # a graph nobody compiled yet
    st.record_miss("graph:absent")  # as cachecompile.procs.coop counts it
    st.get(make_key({"model": "M", "fn": "other"}))
    st.record_miss("absent")
    d = str(st.root)
    rows = json.loads(cachectl(child_env, "ls", "--json", "--cache-dir", d).stdout)
    s = json.loads(cachectl(child_env, "stats", "--json", "--cache-dir", d).stdout)
    assert s["entries"] == len(rows) == 1
    assert (s["hits"], s["misses"]) == (1, {"absent": 1})
    assert s["shared_graphs"] == {"entries": 1, "hits": 2, "misses": {"absent": 1},
                                  "publishes": 1}
    assert s["publishes"] == 1  # the user's (issue 51: one counting rule)
    assert s["bytes"] == len(b"user") + len(b"graph")  # disk use and the cap: everything
    p = cachectl(child_env, "stats", "--cache-dir", d)
    assert p.returncode == 0 and "50.0%" in p.stdout and "shared graphs" in p.stdout
    # verify checks every entry, and says how many of them ls does not list.
    p = cachectl(child_env, "verify", "--cache-dir", d)
    assert p.returncode == 0 and "checked 1 entry (+1 shared graph): ok" in p.stdout


def test_purge_keeps_pinned_entries(cache: Store, child_env: dict[str, str]) -> None:
    d = str(cache.root)
    k = _key(cache, model="mlp")
    pin = cache.pin(k)  # a live process holds it
    p = cachectl(child_env, "purge", "--all", "--yes", "--cache-dir", d)
    assert p.returncode == 0, p.stderr
    assert "removed 2 entries" in p.stdout and "kept 1 pinned" in p.stdout
    assert list(cache.digests()) == [k]
    p = cachectl(child_env, "purge", "--all", "--dry-run", "--cache-dir", d)
    assert "nothing to purge" in p.stdout and "kept 1 pinned" in p.stdout
    p = cachectl(child_env, "purge", "--all", "--yes", "--include-pinned", "--cache-dir", d)
    assert p.returncode == 0 and "removed 1 entry" in p.stdout
    assert list(cache.digests()) == []
    pin.release()


def test_readonly_env_makes_write_verbs_fail(cache: Store, child_env: dict[str, str]) -> None:
    d = str(cache.root)
    env = dict(child_env, CACHECOMPILE_READONLY="1")
    assert cachectl(env, "ls", "--cache-dir", d).returncode == 0
    assert cachectl(env, "verify", "--cache-dir", d).returncode == 0
    # (stats --zero clears only the read-only processes' counters files: tests/store/test_stats.py)
    for verb in (("gc",), ("purge", "--all", "--yes"), ("verify", "--fix")):
        p = cachectl(env, *verb, "--cache-dir", d)
        assert p.returncode == 5, (verb, p.stdout, p.stderr)
        assert "read-only" in p.stderr and "CACHECOMPILE_READONLY" in p.stderr
    assert len(list(cache.digests())) == 3


def test_import_refuses_a_symlinked_tmp_before_staging(cache: Store, tmp_path: Path,
                                                       child_env: dict[str, str]) -> None:
    bundle = tmp_path / "warm.tar"
    p = cachectl(child_env, "export", str(bundle), "--cache-dir", str(cache.root))
    assert p.returncode == 0, p.stderr
    dst = open_store(tmp_path / "dst")
    tmp = dst.root / "v1" / "tmp"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    tmp.rmdir()
    tmp.symlink_to(outside, target_is_directory=True)
    before = os.stat(outside).st_mtime_ns
    p = cachectl(child_env, "import", str(bundle), "--cache-dir", str(dst.root))
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert str(tmp) in p.stderr and "symlink" in p.stderr and "Traceback" not in p.stderr
    # Refused before the archive is staged: nothing was ever created (even briefly)
    # in the directory the link points at.
    assert list(outside.iterdir()) == [] and os.stat(outside).st_mtime_ns == before
    assert list(dst.maintenance().digests()) == []


def test_program_tree_shows_each_path_once_with_its_leaves(tmp_path: Path,
                                                          child_env: dict[str, str]) -> None:
    """`cachectl program --tree`: the guards as the C++ tree checks them, torch-free."""
    st = open_store(tmp_path / "cache")
    lin = "___odict_getitem(L['self']._modules, 'lin')"
    guards = [
        {"kind": "global_state", "expr": "", "value": "{}", "text": "global torch state"},
        {"kind": "type", "expr": "L['self']", "value": "M", "text": "type(self) is M"},
        {"kind": "len", "expr": f"{lin}._forward_hooks", "value": 0,
         "text": "len(self.lin._forward_hooks) == 0"},
        {"kind": "tensor", "expr": f"{lin}._parameters['weight']", "value": {},
         "text": "self.lin.weight is a float32[4,4] Parameter"},
        {"kind": "eq", "expr": "G['ACT']", "value": "relu", "text": "mod.ACT == 'relu'"},
        {"kind": "expr", "expr": "L['x'].size()[0] <= 8", "value": None,
         "text": "x.size()[0] <= 8"},
    ]
    e = st.put(make_key({"model": "M", "fn": "run"}), {"p": b"1"},
               labels={"model": "M", "function": "run"}, meta={"guards": guards})
    r = cachectl(child_env, "program", "--cache-dir", str(tmp_path / "cache"), e.key, "--tree",
                 "--no-bytecode")
    assert r.returncode == 0, r.stderr
    tree = r.stdout.split("the guard tree")[1]
    lines = [line.rstrip() for line in tree.splitlines()]
    assert "  GLOBAL_STATE  global torch state" in lines
    # self's path is walked once; the hooks and weight hang off the shared ['lin'] step.
    assert sum(1 for line in lines if line.strip() == "['lin']") == 1
    at = lines.index("        ._forward_hooks")
    assert lines[at - 1].strip() == "['lin']", lines
    assert lines[at + 1] == "          - DICT_LENGTH / LENGTH_CHECK  len(self.lin._forward_hooks) == 0"
    assert any("TENSOR_MATCH  self.lin.weight" in line for line in lines)
    assert any(line.strip() == "G (globals)" for line in lines)
    assert lines[-2:] == ["python (1, one function on the root)", "  x.size()[0] <= 8"]
