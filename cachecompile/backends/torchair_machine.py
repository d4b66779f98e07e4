"""TorchAir and the machine under it: importing torchair (and torch_npu, when CANN is
there), and what the key needs to know of them: torchair's identity, CANN's version, the
SoC, the NPU flags GE reads; TorchAir's own Dynamo guard and static-kernel options, which
need torch_npu.

Everything here that touches torchair's private API is checked on import
(:func:`import_torchair`); it is the same in the torchair bundled with torch-npu 2.13.0
and 2.14.0, the releases the Ascend tier runs.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from cachecompile.backends.base import package_version
from cachecompile.errors import TorchairUnavailableError, UnsupportedProgramError
from cachecompile.key.factors import canonical
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)

_IMPORT_ERRORS = (ImportError, OSError, RuntimeError)


# -- importing torchair -------------------------------------------------------------------
@functools.cache
def import_torchair() -> tuple[Any, Any]:
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
        import_torchair()
    except TorchairUnavailableError as e:
        return str(e)
    return None


# -- machine factors ----------------------------------------------------------------------
@functools.cache
def torchair_identity() -> dict[str, JSON]:
    """torchair's version, plus its source tree (sizes, mtimes): an edit is a new compiler."""
    import xxhash

    _, torchair = import_torchair()
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
    torch_npu, _ = import_quiet()
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


def import_quiet() -> tuple[Any, Any]:
    try:
        return import_torchair()
    except TorchairUnavailableError:
        return None, None


def soc_name() -> str | None:
    torch_npu, _ = import_quiet()
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


def npu_flags() -> dict[str, JSON]:
    """NPU global state TorchAir reads into GE's options at graph-engine initialisation."""
    torch_npu, _ = import_quiet()
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


def static_kernel_options(build_dir: Path) -> dict[str, str]:
    """TorchAir's extend_config for static kernels (ModelCacheSaver.__init__)."""
    torch_npu, _ = import_torchair()
    if torch_npu is None:
        raise UnsupportedProgramError("static kernels need torch_npu (CANN) to build")
    return {
        "_aclnn_static_shape_kernel.use_cache_compile": "1",
        "_aclnn_static_shape_kernel.cann_version": str(torch_npu.npu.utils.get_cann_version()),
        "_aclnn_static_shape_kernel.compile_cache_dir": str(build_dir),
        "_aclnn_static_shape_kernel.deterministic":
            "1" if torch.are_deterministic_algorithms_enabled() else "0",
    }


def install_deterministic_guard() -> None:
    """TorchAir's Dynamo guard on the NPU deterministic level (needs torch_npu)."""
    try:
        from torch_npu.dynamo._deterministic_guard import install_npu_deterministic_level_guard
    except _IMPORT_ERRORS:
        logger.debug("no torch_npu: the NPU deterministic-level guard is not installed")
        return
    install_npu_deterministic_level_guard()
