"""The Ascend adapter: TorchAir's GE/ACL graph compile, captured as its generated code.

What TorchAir's own ``cache_compile`` keeps, and so what an entry here holds:

* the Python code TorchAir generates for the compiled graph (``_CompiledFxGraph.get_code``:
  the serialized GE graph, its GE options and a ``kernel(*args)`` that loads, compiles
  and runs it). A fresh process execs it and skips Dynamo, AOTAutograd, TorchAir's FX
  passes and the FX -> GE conversion;
* with ``ge_cache=True``: GE's own compile cache. ``ge.graph_compiler_cache_dir`` points
  into a private staging directory; whatever GE writes there (``.om`` / ``.idx``)
  becomes files of the entry, published atomically with the rest, so a fresh process
  also skips the GE graph compile;
* with static kernels (``experimental_config.aclgraph._aclnn_static_shape_kernel``):
  TorchAir's build outputs (``.run`` packages, op JSON) written under the staging
  directory, likewise files of the entry;
* the sources of the graph inputs (``L['self'].layer.weight`` ...) and the input gears,
  in the metadata. Parameters are NOT captured: Dynamo's replayed bytecode reads them
  from the live module on every call, so a weight swap after load is seen.

The miss path mirrors TorchAir's ``CacheBackend`` (torchair/inference/_cache_compiler.py):
``get_npu_backend`` validates the config and merges the decompositions, then
``_compile_graph_with_aot(..., is_cache=True)`` with a forward compiler that asks
TorchAir's ``_NpuFxCompiler`` for its codegen. *Live* is what TorchAir itself runs on a
miss: the generated kernel inside AOTAutograd's runtime wrapper. *Light* is a second,
independent exec of the exact text that is stored (as :meth:`load` does), without
AOTAutograd; capture compares the two before anything is published. On Ascend hardware
with ``ge_cache`` the second run finds GE's cache the first one wrote, so the check also
proves the staged GE cache loads; without ``ge_cache`` it costs a second GE compile.

Entry files are read-only hard links in the store: GE never gets the entry directory
itself. :meth:`load` gives it a private directory of symlinks to them instead.

Everything here that touches torchair's private API (``_compile_graph_with_aot``,
``_compile_py_code``, ``_update_ge_cache_dir``) is checked on import; it is the same in the
torchair bundled with torch-npu 2.13.0 and 2.14.0, the releases the Ascend tier runs.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import logging
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cachecompile import _torch
from cachecompile._torch import dynamo
from cachecompile.backends import torchair_select
from cachecompile.backends.base import (
    JSON,
    Adapter,
    Compiled,
    GraphCallable,
    Program,
    package_version,
)
from cachecompile.entry import files as entry_files
from cachecompile.errors import GearMismatchError, TorchairUnavailableError, UnsupportedProgramError
from cachecompile.key.factors import canonical

logger = logging.getLogger(__name__)

name = "torchair"

PROGRAM_FILE = entry_files.TORCHAIR_PROGRAM
GE_CACHE_PREFIX = "ge_cache/"
STATIC_KERNEL_PREFIX = "static_kernel/"
# Bumped when what this adapter stores, or how it replays it, changes.
CODEGEN_FORMAT = 1
_ACL_MODES = ("reduce-overhead", "npugraph_ex")
# Environment that changes what GE compiles (read by torchair / GE at compile time).
_ENV_KEYS = ("AUTOFUSE_FLAGS", "ASCEND_OPP_PATH", "ASCEND_CUSTOM_OPP_PATH")
_IMPORT_ERRORS = (ImportError, OSError, RuntimeError)


# -- importing torchair -------------------------------------------------------------------
@functools.cache
def _import() -> tuple[Any, Any]:
    """(torch_npu or None, torchair). torch_npu installs the lazy ``torchair`` module.

    Without CANN ``import torch_npu`` fails; torchair's Python still imports where its
    native modules are present (on Ascend) or stood in (the CPU test tier, tests_npu/).
    """
    torch_npu: Any = None
    npu_error: BaseException | None = None
    try:
        torch_npu = importlib.import_module("torch_npu")
    except _IMPORT_ERRORS as e:
        npu_error = e
    try:
        torchair = importlib.import_module("torchair")
        # The private API this adapter drives; fail here, clearly, not inside Dynamo.
        fx = importlib.import_module("torchair.npu_fx_compiler")
        for attr in ("_compile_graph_with_aot", "_compile_py_code", "get_compiler",
                     "_process_send_recv", "get_npu_backend"):
            if not hasattr(fx, attr):
                raise ImportError(f"torchair.npu_fx_compiler has no {attr} (this adapter "
                                  "supports the torchair bundled with torch-npu 2.13 and 2.14)")
    except _IMPORT_ERRORS as e:
        why = f"import torchair failed: {type(e).__name__}: {e}"
        if npu_error is not None:
            why = f"import torch_npu failed: {type(npu_error).__name__}: {npu_error}; " + why
        raise TorchairUnavailableError(why) from e
    return torch_npu, torchair


def unavailable_reason() -> str | None:
    """None if the torchair adapter can run here, else why not (for error messages)."""
    try:
        _import()
    except TorchairUnavailableError as e:
        return str(e)
    return None


# What selects this adapter without its name, light to import (the registry asks it).
is_compiler_config = torchair_select.is_compiler_config
is_npu_backend = torchair_select.is_npu_backend


# -- options: the config, canonically -----------------------------------------------------
class ConfigOptions(Mapping[str, JSON]):
    """Every CompilerConfig option as ``dotted.path -> canonical value``, plus the object.

    A Mapping, so the generic ``config`` key factor lists each option readably
    (``cachectl explain`` names the one that differs). Callables (custom passes) are keyed
    by their code, files named by options by their content. Computed on first use (the
    first call, as TorchAir does); the live object is what the compile uses.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self._items: dict[str, JSON] | None = None

    def _leaves(self) -> dict[str, JSON]:
        if self._items is None:
            self._items = dict(sorted(_config_leaves(self.config).items()))
        return self._items

    def __getitem__(self, key: str) -> JSON:
        return self._leaves()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves())

    def __len__(self) -> int:
        return len(self._leaves())

    def __repr__(self) -> str:
        return f"ConfigOptions({len(self)} options, mode={self.get('mode')!r})"


def _config_leaves(obj: Any, prefix: str = "") -> dict[str, JSON]:
    from torchair.configs._option_base import OptionValue

    file_kinds = tuple(c for c in (_option_class("FileValue"), _option_class("MustExistedFileAddr"))
                       if c is not None)
    out: dict[str, JSON] = {}
    for key, value in sorted(vars(obj).items()):
        if key.startswith("_"):
            continue
        path = prefix + key
        if isinstance(value, OptionValue):
            v = value.value
            if file_kinds and isinstance(value, file_kinds) and isinstance(v, str) and os.path.isfile(v):
                out[path] = {"path": v, "content": _file_digest(v)}
            else:
                out[path] = canonical(v)
        elif hasattr(value, "__dict__") and not callable(value):
            sub = _config_leaves(value, path + ".")
            out.update(sub if sub else {path: type(value).__qualname__})
        else:
            out[path] = canonical(value)
    return out


def _option_class(cls_name: str) -> type | None:
    mod = importlib.import_module("torchair.configs._option_base")
    cls = getattr(mod, cls_name, None)
    return cls if isinstance(cls, type) else None


def _file_digest(path: str) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_options(config: Any, ge_cache: bool) -> dict[str, Any]:
    """The adapter's options (the ``config`` key factor) for a CompilerConfig or None."""
    _, torchair = _import()
    if config is None:
        config = torchair.CompilerConfig()
    mode = config.mode.value
    if ge_cache and mode in _ACL_MODES:
        # TorchAir warns and ignores ge_cache in the aclgraph modes; so do we (and the
        # key says ge_cache=False, so the same entry serves both spellings).
        logger.warning("ge_cache has no effect with config.mode=%r (TorchAir ignores it too)",
                       mode)
        ge_cache = False
    if _static_kernel(config) and _import()[0] is None:
        raise TorchairUnavailableError(
            "experimental_config.aclgraph._aclnn_static_shape_kernel needs torch_npu (CANN) "
            "to build its kernels, and torch_npu does not import here")
    return {"compiler_config": ConfigOptions(config), "ge_cache": bool(ge_cache)}


def _static_kernel(config: Any) -> bool:
    try:
        return bool(config.mode.value in _ACL_MODES
                    and config.experimental_config.aclgraph._aclnn_static_shape_kernel)
    except AttributeError:
        return False


# -- machine factors ----------------------------------------------------------------------
@functools.cache
def _torchair_identity() -> dict[str, JSON]:
    """torchair's version, plus its source tree (sizes, mtimes): an edit is a new compiler."""
    import xxhash

    _, torchair = _import()
    root = Path(torchair.__file__).resolve().parent
    h = xxhash.xxh3_128()
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if fn.endswith((".py", ".so")):
                st = os.stat(os.path.join(dirpath, fn))
                h.update(f"{os.path.relpath(os.path.join(dirpath, fn), root)}:{st.st_size}:"
                         f"{st.st_mtime_ns};".encode())
                n += 1
    return {"version": getattr(torchair, "__version__", None) or package_version("torchair"),
            "path": str(root), "files": n, "tree": h.hexdigest()}


def cann_version() -> str | None:
    """CANN's version: torch_npu's view if it imports, else the install's version file."""
    torch_npu, _ = _import_quiet()
    if torch_npu is not None:
        try:
            v = torch_npu.npu.utils.get_cann_version()
            if v:
                return str(v)
        except Exception:  # fall back to the install's files
            logger.debug("torch_npu.npu.utils.get_cann_version failed", exc_info=True)
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        home = os.environ.get(var)
        if not home:
            continue
        for rel in ("version.info", "compiler/version.info", "runtime/version.info",
                    "ascend_toolkit_install.info"):
            v = _version_from_file(Path(home) / rel)
            if v:
                return v
    return None


def _version_from_file(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep and k.strip().lower() in ("version", "package_version", "innerversion"):
            return v.strip().strip('"') or None
    return None


def _import_quiet() -> tuple[Any, Any]:
    try:
        return _import()
    except TorchairUnavailableError:
        return None, None


def soc_name() -> str | None:
    torch_npu, _ = _import_quiet()
    if torch_npu is not None:
        try:
            return str(torch_npu.npu.get_device_name())
        except Exception:  # fall back to torchair's native query
            logger.debug("torch_npu.npu.get_device_name failed", exc_info=True)
    try:
        native = importlib.import_module("torchair.core._torchair")
        return str(native.GetSocName())
    except Exception:  # no SoC is knowable without the native module
        return None


def _npu_flags() -> dict[str, JSON]:
    """NPU global state TorchAir reads into GE's options at graph-engine initialisation."""
    torch_npu, _ = _import_quiet()
    if torch_npu is None:
        # TorchAir itself assumes level 0 without torch_npu (get_cache_bin).
        return {"deterministic_level": None, "allow_hf32_matmul": None, "allow_hf32_conv": None}
    flags: dict[str, JSON] = {}
    for key, get in (("deterministic_level", lambda: torch_npu.npu._get_deterministic_level()),
                     ("allow_hf32_matmul", lambda: bool(torch_npu.npu.matmul.allow_hf32)),
                     ("allow_hf32_conv", lambda: bool(torch_npu.npu.conv.allow_hf32))):
        try:
            flags[key] = canonical(get())
        except Exception:  # an unknown flag is recorded as unknown
            flags[key] = None
    return flags


# -- staging ------------------------------------------------------------------------------
_TEMP_DIRS: list[str] = []


def _temp_dir(prefix: str) -> Path:
    """A private directory removed at exit (GE writes or reads through it)."""
    if not _TEMP_DIRS:
        atexit.register(_remove_temp_dirs)
    d = tempfile.mkdtemp(prefix=prefix)
    _TEMP_DIRS.append(d)
    return Path(d)


def _remove_temp_dirs() -> None:
    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def _staged_files(root: Path, prefix: str) -> dict[str, Path]:
    out: dict[str, Path] = {}
    if not root.is_dir():
        return out
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[prefix + p.relative_to(root).as_posix()] = p
    return out


def _private_view(files: Mapping[str, Path], prefix: str, tag: str) -> Path:
    """A writable private dir of symlinks to an entry's read-only files under ``prefix``."""
    d = _temp_dir(f"cachecompile-{tag}-")
    for rel, path in files.items():
        if rel.startswith(prefix):
            dst = d / rel[len(prefix):]
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.realpath(path), dst)
    return d


# -- the program --------------------------------------------------------------------------
def _exec_program(src: str, filename: str) -> types.ModuleType:
    """TorchAir's ``_compile_py_code``, with a real file name for tracebacks."""
    mod = types.ModuleType("cachecompile_torchair_program")
    mod.__file__ = filename
    exec(compile(src, filename, "exec"), mod.__dict__)  # verified, owned entry
    return mod


def _point_dirs(mod: types.ModuleType, ge_dir: Path | None, static_dir: Path | None) -> None:
    if ge_dir is not None:
        update = getattr(mod, "_update_ge_cache_dir", None)
        if update is None:
            raise UnsupportedProgramError("torchair's code has no _update_ge_cache_dir although "
                                          "ge_cache is on")
        update(str(ge_dir))
    if static_dir is not None:
        update = getattr(mod, "_update_static_kernel_cache_dir", None)
        if update is None:
            raise UnsupportedProgramError("torchair's code has no _update_static_kernel_cache_dir "
                                          "although static kernels are on")
        update(str(static_dir))


def _gears_of(args: Sequence[Any]) -> dict[str, JSON]:
    """Input index -> {dim: gears} for inputs marked with torchair's set_dim_gears."""
    out: dict[str, JSON] = {}
    for i, a in enumerate(args):
        g = getattr(a, "dim_gears", None) if isinstance(a, torch.Tensor) else None
        if g:
            out[str(i)] = {str(d): list(v) for d, v in sorted(g.items())}
    return out


def _with_gear_check(kernel: Callable[..., Any], gears: Mapping[str, JSON]) -> GraphCallable:
    # Gears are not part of the call signature (a hook in signature.py would make them a
    # key factor, see docs/ascend.md); until then, check them on every call of a hit
    # instead of running a GE graph built for other gears.
    def compiled_fn(*args: Any) -> Any:
        seen = _gears_of(args)
        if seen != gears:
            raise GearMismatchError(
                f"this cached program was compiled for input gears {dict(gears) or 'none'}, "
                f"but the call's inputs carry {seen or 'none'}; set_dim_gears must be the "
                "same on every run (or clear the cache entry)")
        return kernel(*args)

    return compiled_fn


def _input_sources(gm: Any) -> list[str]:
    out: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        label = dynamo.placeholder_source(node)
        out.append(label if label is not None else node.name)
    return out


def _no_backward(gm: Any, example_inputs: Sequence[Any]) -> Any:
    raise RuntimeError("cache_compile is inference only: no backward graph")


class TorchairAdapter(Adapter):
    name = "torchair"
    shares_graphs = True
    torch_parts = (_torch.DYNAMO,)

    def factors(self, options: Mapping[str, Any]) -> dict[str, JSON]:
        torch_npu, _ = _import_quiet()
        cfg = options["compiler_config"].config
        return {
            "codegen_format": CODEGEN_FORMAT,
            "torchair": _torchair_identity(),
            "torch_npu": package_version("torch-npu") or getattr(torch_npu, "__version__", None),
            "torch_npu_imported": torch_npu is not None,
            "cann": cann_version(),
            "soc": soc_name(),
            "npu": _npu_flags(),
            "ge_cache": bool(options.get("ge_cache")),
            "static_kernel": _static_kernel(cfg),
            "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
        }

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        _import()
        import torchair
        from torchair import npu_fx_compiler as fx

        config = options["compiler_config"].config
        ge_cache = bool(options.get("ge_cache"))
        static = _static_kernel(config)
        stage = _temp_dir("cachecompile-torchair-stage-")
        ge_dir = stage / "ge_cache" if ge_cache else None
        static_dir = stage / "static_kernel" if static else None
        extend: dict[str, str] = {}
        if ge_dir is not None:
            ge_dir.mkdir()
            extend["ge.graph_compiler_cache_dir"] = str(ge_dir)
        if static_dir is not None:
            static_dir.mkdir()
            extend.update(_static_kernel_options(static_dir))

        # Validates the config and merges TorchAir's default decompositions with the
        # user's, exactly as a user's torch.compile(backend=get_npu_backend(...)) would.
        backend = torchair.get_npu_backend(compiler_config=config,
                                           custom_decompositions=dict(decompositions or {}))
        merged = backend.keywords["decompositions"]
        compiler = fx.get_compiler(config)
        captured: list[tuple[str | None, Any]] = []

        def fw_compiler(fx_gm: Any, ex: Sequence[Any]) -> Any:
            runner = compiler(fx_gm, ex)
            code = runner.get_code(extend)
            if not isinstance(code, str):
                # TorchAir does not generate code for some configs (enable_ref_data, export,
                # aoe, fx_summary, data_dump): run it live, do not cache.
                captured.append((None, fx_gm))
                return code
            captured.append((code, fx_gm))
            mod = fx._compile_py_code(code)
            _point_dirs(mod, ge_dir, static_dir)
            return mod.kernel

        _install_deterministic_guard()
        fx._process_send_recv(gm, config)
        n_inputs = len(example_inputs)
        sources = _input_sources(gm)
        aot_live = fx._compile_graph_with_aot(gm, fw_compiler, list(example_inputs), config,
                                              merged, is_cache=True, bw_compiler=_no_backward)
        holder: dict[str, Program] = {}

        def live(*args: Any) -> Any:
            out = aot_live(*args)
            program = holder.pop("program", None)
            if program is not None:
                # Both runs (light first, then this one) are done: GE has written its
                # cache and TorchAir its static-kernel builds into the staging dir.
                if ge_dir is not None:
                    program.files.update(_staged_files(ge_dir, GE_CACHE_PREFIX))
                if static_dir is not None:
                    program.files.update(_staged_files(static_dir, STATIC_KERNEL_PREFIX))
                program.meta["staged_files"] = sorted(k for k in program.files if k != PROGRAM_FILE)
            return out

        def program() -> Program:
            if len(captured) != 1:
                raise UnsupportedProgramError(f"expected one torchair graph, got {len(captured)}")
            code, fx_gm = captured[0]
            if code is None:
                raise UnsupportedProgramError(
                    "torchair generated no code for this config (enable_ref_data, export_mode, "
                    "aoe_mode, fx_summary or data_dump are not cacheable)")
            placeholders = [n for n in fx_gm.graph.nodes if n.op == "placeholder"]
            if len(placeholders) != n_inputs:
                raise UnsupportedProgramError(
                    f"AOTAutograd changed the inputs ({n_inputs} graph inputs, "
                    f"{len(placeholders)} compiled)")
            mutated = tuple(i for i, p in enumerate(placeholders)
                            if any(u.target is torch.ops.aten.copy_.default and u.args[0] is p
                                   for u in p.users))
            meta: dict[str, JSON] = {
                "mode": config.mode.value,
                "ge_cache": ge_cache,
                "static_kernel": static,
                "inputs": sources,
                "n_inputs": n_inputs,
                "mutated_inputs": list(mutated),
                "gears": {},
                "python": list(sys.version_info[:2]),
            }
            files: dict[str, bytes | Path] = {PROGRAM_FILE: code.encode("utf-8")}
            light_mod = _exec_program(code, "<cachecompile torchair capture>")
            _point_dirs(light_mod, ge_dir, static_dir)
            kernel = light_mod.kernel

            def light(*args: Any) -> Any:
                meta["gears"] = _gears_of(args)
                return kernel(*args)

            prog = Program(files=files, meta=meta, light=light, mutated_inputs=mutated)
            holder["program"] = prog
            return prog

        return Compiled(live=live, program=program)

    def load(self, files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
        _import()
        path = files[PROGRAM_FILE]
        mod = _exec_program(path.read_text(encoding="utf-8"), str(path))
        ge_dir = _private_view(files, GE_CACHE_PREFIX, "ge") if meta.get("ge_cache") else None
        static_dir = (_private_view(files, STATIC_KERNEL_PREFIX, "static-kernel")
                      if meta.get("static_kernel") else None)
        _point_dirs(mod, ge_dir, static_dir)
        kernel: Callable[..., Any] = mod.kernel
        return _with_gear_check(kernel, meta.get("gears") or {})

    def with_passes(self, options: Mapping[str, Any], passes: Any) -> Mapping[str, Any]:
        if passes is None:
            return options
        raise ValueError("passes= are Inductor's custom pass hooks; the 'torchair' backend "
                         "does not run them (give them in its CompilerConfig)")

    def default_cache_dir(self) -> str | None:
        # TorchAir's own default (its cache_compile's), unless cachecompile's variable
        # names one: a drop-in keeps its users' caches where they were.
        if os.environ.get("CACHECOMPILE_DIR"):
            return None
        return os.path.abspath(os.environ.get("TORCHAIR_CACHE_HOME") or ".torchair_cache")

    def plain_backend(self, options: Mapping[str, Any], decompositions: Mapping[Any, Any] | None
                      ) -> tuple[Any, dict[str, Any] | None]:
        _, torchair = _import()
        return torchair.get_npu_backend(compiler_config=options["compiler_config"].config,
                                        custom_decompositions=dict(decompositions or {})), None


def _static_kernel_options(build_dir: Path) -> dict[str, str]:
    """TorchAir's extend_config for static kernels (ModelCacheSaver.__init__)."""
    torch_npu, _ = _import()
    if torch_npu is None:
        raise UnsupportedProgramError("static kernels need torch_npu (CANN) to build")
    return {
        "_aclnn_static_shape_kernel.use_cache_compile": "1",
        "_aclnn_static_shape_kernel.cann_version": str(torch_npu.npu.utils.get_cann_version()),
        "_aclnn_static_shape_kernel.compile_cache_dir": str(build_dir),
        "_aclnn_static_shape_kernel.deterministic":
            "1" if torch.are_deterministic_algorithms_enabled() else "0",
    }


def _install_deterministic_guard() -> None:
    """TorchAir's Dynamo guard on the NPU deterministic level (needs torch_npu)."""
    try:
        from torch_npu.dynamo._deterministic_guard import install_npu_deterministic_level_guard
    except _IMPORT_ERRORS:
        logger.debug("no torch_npu: the NPU deterministic-level guard is not installed")
        return
    install_npu_deterministic_level_guard()


ADAPTER = TorchairAdapter()
