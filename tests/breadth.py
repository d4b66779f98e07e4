"""What the README's test command leaves to CI: the second and further cases of a promise
that another test in the command already checks (issue 65).

The README command runs each behaviour once: on the default backend, with one model of
each kind, one remote server per test that runs the same steps over several. The cases
marked here run the same test again over another backend, model family, server or
setting. They are marked ``breadth`` at collection (tests/conftest.py); the README command
deselects them (``-m "not breadth"``), CI runs them right after it (``.ci/breadth.sh``:
``-m breadth``), and a plain ``pytest`` runs both. Nothing here is skipped: a case left
out of the README command still runs on every CI run.

Two kinds of entry, each with why it is breadth:

* every test parametrized over ``backend`` with both ``inductor`` and ``aot_eager``: its
  ``aot_eager`` case (the README command runs the default backend's; the guide asks for
  both, and CI runs both);
* ``CASES``: a node id, whole or with its parameters, and the README-command test that
  checks the same promise.

A ``CASES`` entry that names no collected test fails a collection of its whole file (not
one narrowed by a node id or ``--lf``: ``whole``), so that this list cannot point at a
renamed test and silently keep its case in the README command.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

MARK = "breadth"

# node id (relative to the repository) -> the README-command test that keeps the promise.
CASES: Mapping[str, str] = {
    # Model families beyond the first of each kind: Llama (and its decorated forward)
    # stays, with its two layers, StaticCache decode and a new batch after hits.
    "tests/e2e/test_zoo.py::test_zoo_model[mistral]": "test_zoo_model[llama]",
    "tests/e2e/test_zoo.py::test_zoo_model[unet]": "test_zoo_model[llama]",
    "tests/e2e/test_zoo.py::test_zoo_model[dit]": "test_zoo_model[llama-forward]",
    # Graph-broken families beyond Qwen2-VL (192 frames, four image grids).
    **{f"tests/e2e/test_graph_break_models.py::"
       f"test_a_model_that_breaks_in_its_own_code_is_served_with_nothing_traced[{name}]":
       "...[qwen2_vl]"
       for name in ("longformer", "reformer", "switch", "paligemma", "denoise")},
    # The same state changes after the first call, on a diffusers model.
    "tests/e2e/test_state_changes.py::test_diffusers_state_changes_after_the_first_call":
        "test_llama_state_changes_after_the_first_call[inductor]",
    # The same setting-change check for a second setting.
    "tests/e2e/test_trust.py::"
    "test_a_frame_compiled_after_a_setting_changed_is_not_served_to_the_defaults[default_dtype]":
        "...[fallback_random]",
    # The same multi-process steps over each remote server: the README command keeps one
    # (the chain of two tiers for forks), and every server's own protocol in-process
    # (tests/store/test_*_tier.py, test_s3.py, test_remote.py).
    **{f"tests/procs/test_remote_procs.py::test_node_b_loads_node_a_entry_with_zero_compiles[{t}]":
       "...[s3]" for t in ("redis", "file", "http", "oci")},
    "tests/procs/test_remote_procs.py::"
    "test_two_nodes_serve_byte_exact_under_a_concurrent_gc_and_purge[file]": "...[http]",
    **{f"tests/procs/test_fork_tiers.py::{test}[{t}]": "...[http,moto]"
       for test in ("test_forked_children_hit_and_the_parent_lives",
                    "test_forked_children_upload_what_they_publish")
       for t in ("moto", "s3rver", "redis", "file", "http", "oci")},
    # A second job scheduler around the same nested torchrun build.
    "tests/cli/test_build_shards.py::"
    "test_torchrun_nested_in_an_array_task_builds_each_signature_once[kubernetes]":
        "...[slurm]",
    # Each rank its own graph, one group: the uneven shards' test checks that and more
    # (every rank also its own signature).
    "tests/procs/test_ranks.py::test_rank_dependent_graphs_compile_separately":
        "test_uneven_shards_form_one_group",
    # Generated cases: the guard matrix checks every guard kind by hand (on Inductor), and
    # CI's guard sweep runs 256 more of the generator's (.ci/guard-sweep.sh); a second
    # seed of the last-variant generator.
    "tests/e2e/test_guard_sweep.py::test_generated_cases_have_no_wrong_hit[0]":
        "test_guard_matrix[inductor]",
    "tests/e2e/test_last_variant.py::"
    "test_the_last_variant_first_is_torch_compile[aot_eager-53-60-ints0]":
        "...[inductor-54-24-ints1]",
    # The deploy page followed step by step: its build, bundle and warm serve are each
    # a README-command test (tests/cli/test_prebuild.py, test_build_shards.py,
    # tests/store/test_bundle.py); the README's own demo follows its docs literally
    # (tests/demo/test_demo.py).
    "tests/e2e/test_deploy.py::test_deploy_page_step_by_step":
        "tests/cli/test_prebuild.py::test_cachectl_build_then_a_warm_process_compiles_nothing, "
        "tests/demo/test_demo.py::test_demo_runs_cold_then_warm",
}


def _backend_values(marker: pytest.Mark) -> list[object] | None:
    """The ``backend`` values of a parametrize marker, if it names ``backend``."""
    names, values = marker.args[0], marker.args[1]
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    if "backend" not in names:
        return None
    at = names.index("backend")
    out = []
    for v in values:
        given = getattr(v, "values", None)   # pytest.param(...): a ParameterSet's values
        row = given if isinstance(given, tuple) else (v,) if len(names) == 1 else tuple(v)
        out.append(row[at])
    return out


def _aot_eager_twin(item: pytest.Item) -> bool:
    """An ``aot_eager`` case of a test whose ``backend`` parametrization also has
    ``inductor``: decided by the test's own parametrization, so that a case is breadth or
    not whatever else a run selects."""
    params = getattr(getattr(item, "callspec", None), "params", None)
    if not params or params.get("backend") != "aot_eager":
        return False
    for marker in item.iter_markers("parametrize"):
        found = _backend_values(marker)
        if found is not None and "inductor" in found:
            return True
    return False


def whole(config: pytest.Config) -> bool:
    """Whether this session collects every test of each file it names: not when its
    arguments name tests (``::``) or ``--lf`` narrows the collection to what failed."""
    return not (any("::" in arg for arg in config.args) or config.getoption("lf", False))


def mark(items: list[pytest.Item], check: bool) -> int:
    """Mark the breadth cases among ``items`` (a session's collection, before -m and -k
    deselect) and return how many. With ``check`` (a whole collection: ``whole``), fail on
    a ``CASES`` entry whose file was collected but which names no test in it."""
    collected = {item.nodeid for item in items}
    if check:
        files = {nodeid.split("::", 1)[0] for nodeid in collected}
        stale = [case for case in CASES
                 if case.split("::", 1)[0] in files and case not in collected]
        if stale:
            raise pytest.UsageError(
                "tests/breadth.py names tests that were not collected: "
                + ", ".join(stale) + ". If a test was renamed or removed, update CASES in "
                "tests/breadth.py to match (a case it names is left out of the README command).")
    count = 0
    for item in items:
        if item.nodeid in CASES or _aot_eager_twin(item):
            item.add_marker(MARK)
            count += 1
    return count
