"""One measurement of tools/bench_compile.py, in a fresh process.

Not meant to be run by hand: the parent sets up the environment (TMPDIR,
TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, CACHECOMPILE_DIR) and reads the lines
this script prints on stdout:

- ``FIRST_OUTPUT {json}`` as soon as the first output has been computed and
  checked against eager (the parent timestamps this line);
- ``RESULT {json}`` at the end (per-call latency, artifact sizes, ...);
- ``UNAVAILABLE {json}`` when the mechanism cannot run here (cachecompile not importable).

Everything runs under ``torch.no_grad()``: the compiled callables are inference only.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

_t0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - _t0

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cachecompile.demo.models import (  # noqa: E402
    AddOne,
    DecoderConfig,
    anchor_config,
    build_decoder,
    demo_config,
    make_inputs,
)

RTOL = 1e-4
ATOL = 1e-4


class Unavailable(Exception):
    """The mechanism cannot run in this environment (reported as n/a, not as a failure)."""


def emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def dir_bytes(path: str | os.PathLike[str]) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def torch_phases() -> dict[str, float]:
    """torch's own compile timers (``dynamo_timed``), summed per name: the same names for
    torch.compile and for cache_compile's cold path, which runs the same compiler."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: round(sum(v), 4) for k, v in compilation_time_metrics.items()}


def cc_phases(root: str) -> dict[str, float]:
    """cachecompile's cold phases (``cold_phases`` in each entry's meta), summed."""
    total: dict[str, float] = {}
    for manifest in Path(root).rglob("manifest.json"):
        meta = json.loads(manifest.read_text()).get("meta", {})
        for k, v in (meta.get("cold_phases") or {}).items():
            total[k] = round(total.get(k, 0.0) + float(v), 4)
    return total


def config_for(name: str) -> DecoderConfig:
    return demo_config() if name == "demo" else anchor_config()


def build_hf() -> tuple[Any, torch.Tensor]:
    """A transformers Llama (tools/bench_hf_model.py: hidden 256, 4 layers, random
    weights) whose ``prefill(input_ids)`` returns the logits."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_hf_model

    return bench_hf_model.build()


def import_cache_compile() -> Callable[..., Any]:
    try:
        from cachecompile import cache_compile
    except Exception as exc:  # any import failure means "not available yet"
        raise Unavailable(f"import failed: {type(exc).__name__}: {exc}") from exc
    return cache_compile


def per_call_us(call: Callable[[], Any], warmup: int, calls: int) -> float:
    """Median latency of single calls, in microseconds."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def per_call_us_batched(call: Callable[[], Any], inner: int = 1000, reps: int = 31) -> float:
    """Median over ``reps`` loops of ``inner`` calls, per call, in microseconds (tiny graphs)."""
    for _ in range(inner):
        call()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - t) / inner)
    return statistics.median(samples) * 1e6


def build_callable(
    mech: str, phase: str, model: Any, example: torch.Tensor, work: Path
) -> tuple[Callable[[], torch.Tensor], dict[str, Any]]:
    """Make the mechanism's callable (compiling or loading as needed); return it and facts."""
    info: dict[str, Any] = {}
    if mech == "eager":
        return (lambda: model.prefill(example)), info

    if mech in ("compile_cold", "compile_warm"):
        compiled = torch.compile(model.prefill, fullgraph=True, dynamic=False)
        return (lambda: compiled(example)), info

    if mech == "artifacts":
        blob = work / "cache_artifacts.bin"
        if phase == "produce":
            compiled = torch.compile(model.prefill, fullgraph=True, dynamic=False)
            compiled(example)
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                raise RuntimeError("save_cache_artifacts returned None")
            blob.write_bytes(saved[0])
            info["artifact_bytes"] = len(saved[0])
            return (lambda: compiled(example)), info
        loaded = torch.compiler.load_cache_artifacts(blob.read_bytes())
        info["loaded"] = loaded is not None
        compiled = torch.compile(model.prefill, fullgraph=True, dynamic=False)
        return (lambda: compiled(example)), info

    if mech in ("aot_precompile", "aot_precompile_empty"):
        # aot_compile unwraps the bound method: the result takes the module as its first
        # argument (fn(model, tokens)); the module is then an input, not pickled state.
        blob = work / "aot_precompile.bin"
        if phase == "produce":
            aot: Any = torch.compile(model.prefill, fullgraph=True, dynamic=False)
            fn = aot.aot_compile(((example,), {}))
            fn.save_compiled_function(str(blob))
            info["artifact_bytes"] = blob.stat().st_size
        else:
            with open(blob, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
        return (lambda: fn(model, example)), info

    if mech == "aoti":
        from torch._inductor import aoti_compile_and_package, aoti_load_package

        package = work / "model.pt2"
        if phase == "produce":
            exported = torch.export.export(model, (example,))
            aoti_compile_and_package(exported, package_path=str(package))
            info["artifact_bytes"] = package.stat().st_size
        runner = aoti_load_package(str(package))
        return (lambda: runner(example)), info

    if mech in ("cc_cold", "cc_warm"):
        cache_compile = import_cache_compile()
        cc_dir = os.environ["CACHECOMPILE_DIR"]
        try:
            model.cached = cache_compile(model.prefill, dynamic=False, cache_dir=cc_dir)
        except Exception as exc:  # the API may still be in flux
            raise Unavailable(f"cache_compile() failed: {type(exc).__name__}: {exc}") from exc
        return (lambda: model.cached(example)), info

    raise SystemExit(f"unknown mechanism {mech!r}")


def run_model(args: argparse.Namespace) -> None:
    work = Path(args.work)
    if args.model == "hf":
        model, example = build_hf()
    else:
        model = build_decoder(config_for(args.model), seed=0)
        example = make_inputs(model, seed=0)
    with torch.no_grad():
        try:
            call, info = build_callable(args.mech, args.phase, model, example, work)
            out = call()
        except Unavailable as exc:
            emit("UNAVAILABLE", {"reason": str(exc)})
            return
        first_s = time.perf_counter() - T_START
        expected = model.prefill(example)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        emit(
            "FIRST_OUTPUT",
            {
                "child_first_output_s": first_s,
                "import_torch_s": IMPORT_TORCH_S,
                "max_abs_err": float((out - expected).abs().max()),
            },
        )
        latency = per_call_us(call, args.warmup, args.calls)
    result: dict[str, Any] = {"per_call_us": latency, **info}
    if args.mech in ("compile_cold", "cc_cold"):
        result["torch_phases"] = torch_phases()
    if args.mech == "cc_cold":
        result["cold_phases"] = cc_phases(os.environ["CACHECOMPILE_DIR"])
    if args.mech in ("cc_cold", "cc_warm"):
        result.setdefault("artifact_bytes", dir_bytes(os.environ["CACHECOMPILE_DIR"]))
    elif args.mech in ("compile_cold", "compile_warm"):
        result.setdefault("artifact_bytes", dir_bytes(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    emit("RESULT", result)


def run_micro(args: argparse.Namespace) -> None:  # noqa: C901 (today's exception: one branch per mechanism measured)
    """Per-call overhead of ``x + 1`` on 4 floats through a module method."""
    work = Path(args.work)
    module = AddOne()
    x = torch.zeros(4)
    mech = args.mech
    with torch.no_grad():
        try:
            if mech == "eager":

                def call() -> torch.Tensor:
                    return module.add(x)

            elif mech == "compile":
                compiled = torch.compile(module.add, fullgraph=True, dynamic=False)

                def call() -> torch.Tensor:
                    return compiled(x)

            elif mech in ("aot_precompile", "aot_precompile_noguard"):
                blob = work / "micro_aot.bin"
                aot: Any = torch.compile(module.add, fullgraph=True, dynamic=False)
                fn0 = aot.aot_compile(((x,), {}))
                fn0.save_compiled_function(str(blob))
                with open(blob, "rb") as f:
                    fn: Any = torch.compiler.load_compiled_function(f)
                if mech == "aot_precompile_noguard":
                    fn.disable_guard_check()

                def call() -> torch.Tensor:
                    return fn(module, x)

            elif mech in ("cc_warm", "cc_warm_always"):
                cache_compile = import_cache_compile()
                try:
                    # cc_warm_always: every guard on every call, as torch.compile does.
                    cached = cache_compile(
                        module.add, dynamic=False, cache_dir=os.environ["CACHECOMPILE_DIR"],
                        guards="always" if mech == "cc_warm_always" else "first",
                    )
                except Exception as exc:
                    raise Unavailable(
                        f"cache_compile() failed: {type(exc).__name__}: {exc}"
                    ) from exc

                def call() -> torch.Tensor:
                    return cached(x)

            else:
                raise SystemExit(f"unknown micro mechanism {mech!r}")
            out = call()
        except Unavailable as exc:
            emit("UNAVAILABLE", {"reason": str(exc)})
            return
        torch.testing.assert_close(out, x + 1)
        emit("FIRST_OUTPUT", {"child_first_output_s": time.perf_counter() - T_START})
        if args.phase == "produce":
            emit("RESULT", {})
            return
        emit("RESULT", {"per_call_us": per_call_us_batched(call)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mech", required=True)
    parser.add_argument("--phase", choices=("produce", "run"), default="run")
    parser.add_argument("--model", choices=("demo", "anchor", "hf", "micro"), required=True)
    parser.add_argument("--work", required=True, help="shared work dir for produced artifacts")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if args.model == "micro":
        run_micro(args)
    else:
        run_model(args)


if __name__ == "__main__":
    main()
