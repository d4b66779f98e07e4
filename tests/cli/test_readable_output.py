"""What cachectl prints for people (issue 51): a section of docs/cli.md per verb and
``--help`` summaries whole; guards in the user's names with hook checks folded; one
counting rule across verbs; a signature printed one way everywhere.

The verbs run in this process through click's runner (tests/ccutil.py); the entries are
put through the store, or (for guards) compiled in-process on aot_eager."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ccutil
import click
import pytest
from click.testing import CliRunner

from cachecompile.cli import readable
from cachecompile.cli.main import cli
from cachecompile.store import make_key, open_store

REPO = Path(__file__).resolve().parents[2]


def _verbs(group: click.Group = cli, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append((prefix + name, cmd))
        if isinstance(cmd, click.Group):
            out += _verbs(cmd, prefix + name + " ")
    return out


# -- 6. docs and --help -------------------------------------------------------------------
def test_docs_cli_has_a_section_per_verb() -> None:
    text = (REPO / "docs" / "cli.md").read_text()
    headings = re.findall(r"^## `cachectl ([a-z-]+)", text, re.M)
    top = [name for name, _ in _verbs() if " " not in name]
    assert len(top) == 16
    assert sorted(set(headings)) == sorted(top), set(top) ^ set(headings)
    remote = text[text.index("## `cachectl remote"):]
    for name, _ in _verbs():
        if name.startswith("remote "):
            assert f"`{name} " in remote, f"docs/cli.md says nothing of `cachectl {name}`"
    assert "`--json` prints one object for scripts" in text  # stats --json, described


def test_help_summaries_are_whole() -> None:
    help_text = CliRunner().invoke(cli, ["--help"], terminal_width=80).output
    listed = help_text[help_text.index("Commands:"):].splitlines()[1:]
    assert len([ln for ln in listed if ln.strip()]) == 16, help_text
    for line in listed:
        assert len(line) <= 80 and not line.rstrip().endswith("..."), line
    for name, cmd in _verbs():
        short = cmd.get_short_help_str(limit=45)
        assert short and not short.endswith("..."), (name, short)
        assert cmd.short_help is not None and len(cmd.short_help) <= 55, name


# -- 7. guards in the user's names, folded ------------------------------------------------
def test_demangled_names_and_folded_hooks() -> None:
    texts = [
        "len(__main__.__import_torch_dot_nn_dot_modules_dot_module._global_forward_hooks)"
        " == 0 (global module hooks)",
        "x is a float32[2,16] Tensor on cpu, strides [16,1]",
        "type(__main__.__import_torch_dot_nn_dot_modules_dot_module._global_backward_hooks)"
        " is collections.OrderedDict",
        *(f"len(self._modules['{m}']._{h}) == 0" for m in ("fc1", "fc2")
          for h in ("forward_hooks", "backward_hooks", "forward_pre_hooks",
                    "backward_pre_hooks", "forward_hooks_with_kwargs",
                    "forward_pre_hooks_with_kwargs", "state_dict_hooks", "load_state_dict_pre_hooks")),
        "__builtins_dict___16['len'] is builtin:len",
        "mymod.__import_torch_dot__dynamo_dot_utils is module:torch._dynamo.utils",
    ]
    shown = [readable.demangle(t) for t in texts]
    assert shown[0].startswith("len(torch.nn.modules.module._global_forward_hooks)")
    assert shown[-2] == "builtins.len is builtin:len"
    assert shown[-1] == "torch._dynamo.utils is module:torch._dynamo.utils"
    assert [line for _, line in readable.fold_hooks(shown)] == [
        "no global module hooks (2 checks)",
        "x is a float32[2,16] Tensor on cpu, strides [16,1]",
        "fc1, fc2: no hooks (16 checks)",
        "builtins.len is builtin:len",
        "torch._dynamo.utils is module:torch._dynamo.utils",
    ]
    assert readable.ranges([3, 4, 5, 7, 9, 10]) == "3-5,7,9-10"


class TwoLayers(__import__("torch").nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        import torch

        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def run(self, x):
        import torch

        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def mlp_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """A 2-layer MLP's entries, a static and a dynamic one (aot_eager, in-process)."""
    import torch

    from cachecompile import cache_compile

    d = str(tmp_path_factory.mktemp("readable") / "cc")
    m = TwoLayers().eval()
    with torch.no_grad():
        cache_compile(m.run, backend="aot_eager", cache_dir=d, dynamic=False)(torch.randn(2, 16))
        cache_compile(m.run, backend="aot_eager", cache_dir=d)(torch.randn(3, 16))
    rows = json.loads(ccutil.cachectl("ls", "--json", "--cache-dir", d).stdout)
    by = {r["labels"]["dynamic"]: r["key"] for r in rows}
    return d, by["false"], by["true"]


def test_show_explain_and_program_print_guards_readably(mlp_store: tuple[str, str, str]) -> None:
    d, static, dynamic = mlp_store
    shown = ccutil.cachectl("show", static, "--cache-dir", d).stdout
    assert "__import_" not in shown and "_dot_" not in shown, shown
    assert "fc1, fc2: no hooks (" in shown and "no global module hooks (4 checks)" in shown
    assert "_forward_hooks) == 0" not in shown
    # The signature factor as a signature, not as the key's JSON.
    assert re.search(r"^signature\s+float32\[2,16\]@cpu\s*$", shown, re.M), shown
    assert '["T"' not in shown
    explained = ccutil.cachectl("explain", static, dynamic, "--cache-dir", d).stdout
    assert re.search(r"\* signature\s+float32\[2,16\]@cpu\s+float32\[n,n\]@cpu", explained), \
        explained
    program = ccutil.cachectl("program", static, "--no-bytecode", "--cache-dir", d).stdout
    start = program.index("# ---- guards")
    guards = program[start:program.index("# ---- ", start + 1)]
    assert "__import_" not in guards and "torch.nn.modules.module" in guards
    folded = [ln for ln in guards.splitlines() if "no hooks" in ln]
    assert len(folded) == 1 and re.search(r"fc1, fc2: no hooks \(\d+ checks\) \[[\d,-]+\]",
                                          folded[0]), folded


# -- 7. one counting rule ------------------------------------------------------------------
def test_every_verb_counts_entries_one_way(tmp_path: Path) -> None:
    st = open_store(tmp_path / "cc")
    for fn in ("f", "g"):
        st.put(make_key({"model": "M", "fn": fn}), {"a": fn.encode()},
               labels={"model": "M", "function": fn})
    st.put(make_key({"kind": "graph", "graph": "g" * 32}), {"p": b"graph"},
           labels={"kind": "graph", "model": "M", "function": "(shared graph)"})
    d = str(st.root)
    phrase = "2 entries (+1 shared graph)"

    def run(*args: str) -> str:
        r = ccutil.cachectl(*args, "--cache-dir", d)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    assert phrase + ", the shared graphs not listed (--graphs lists them)" in run("ls")
    assert phrase in run("ls", "--graphs")
    assert re.search(r"^entries\s+2 \(\+1 shared graph\)$", run("stats"), re.M)
    assert re.search(r"^publishes\s+2 \(\+1 shared graph\)$", run("stats"), re.M)
    assert f"checked {phrase}" in run("verify")
    assert f"exported {phrase}" in run("export", str(tmp_path / "b.tar"))
    assert f"{phrase}, " in run("purge", "--model", "M", "--dry-run")
    other = tmp_path / "other"
    r = ccutil.cachectl("import", str(tmp_path / "b.tar"), "--cache-dir", str(other))
    assert f"imported {phrase}" in r.stdout, r.stdout
    assert f"removed {phrase}" in run("purge", "--model", "M", "--yes")


def test_check_names_the_nearest_entrys_factors() -> None:
    from cachecompile.cli.build import _missing_line

    t = {"name": "Mlp.f", "signature": "float32[2,16]@cpu", "key": "a" * 32,
         "nearest": {"key": "b" * 32, "differ": {"backend.compiler.cxx": ["clang++", "g++"],
                                                  "signature": [[["T", "torch.float32", "cpu",
                                                                  [2, 16], True, False, None]],
                                                                [["T", "torch.float32", "cpu",
                                                                  [4, 16], True, False, None]]]}}}
    line = _missing_line(t, None)
    assert line.splitlines()[0] == f"missing  Mlp.f [float32[2,16]@cpu]  {'a' * 12}"
    assert ('nearest entry bbbbbbbbbbbb differs in backend.compiler.cxx ("clang++" here, '
            '"g++" there), signature (float32[2,16]@cpu here, float32[4,16]@cpu there)') in line
    assert _missing_line({**t, "nearest": None}, "x86-64-v3").endswith("(x86-64-v3)")


def test_check_explains_a_miss_through_one_path() -> None:
    """``--check``'s nearest entry and its likely causes: one shape of data (``{factor:
    [here, there]}``, made by the check) and one formatter, so the missing line and the
    cause give a factor's values alike (a factor one side lacks is ``unset``)."""
    from cachecompile.cli.build import _cause_text, _missing_line
    from cachecompile.procs.builders import _nearest, likely_causes

    fn = {"module": "m", "qualname": "Mlp.f"}
    env = {"OMP_NUM_THREADS": "4"}
    ours = {"function": fn, "signature": "s", "backend": {"num_threads": 2, "env": env}}
    tier = [("b" * 32, {**ours, "signature": "t"}),
            ("a" * 32, {**ours, "backend": {"num_threads": 1, "env": {**env, "CXX": "g++"}}})]
    near = _nearest(ours, tier)  # the same signature first, though it differs in more
    assert near == {"key": "a" * 32, "differ": {"backend.env.CXX": [None, "g++"],
                                                "backend.num_threads": [2, 1]}}
    t = {"name": "Mlp.f", "signature": "float32[2,16]@cpu", "key": "c" * 32, "nearest": near}
    line = _missing_line(t, None)
    causes = [_cause_text(c) for c in likely_causes([t, {**t, "nearest": None}])]
    assert len(causes) == 2, causes
    threads, cxx = causes
    assert threads.startswith("the thread count") and "1 of the 2 missing" in threads
    assert cxx.startswith("the C++ compiler")
    for shown in ('backend.env.CXX (unset here, "g++" there)',
                  "backend.num_threads (2 here, 1 there)"):
        assert shown in line and shown in threads + cxx, (line, causes)


def test_two_signatures_that_differ_print_apart() -> None:
    # The demo's two prefill entries: the same shapes, one called with inference tensors.
    plain = [["T", "torch.int64", "cpu", [-1, -1], True, False, None]]
    inference = [["T", "torch.int64", "cpu", [-1, -1], True, True, None]]
    assert readable.factor_text("signature", plain) == "int64[n,n]@cpu"
    assert readable.factor_text("signature", inference) == "int64[n,n]@cpu inference"
    assert readable.factor_text("dynamic", True) == "true"
