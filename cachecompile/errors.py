"""Errors and warnings raised by cachecompile's torch integration.

Hierarchy::

    CacheCompileError (Exception)
    ├── ContractError (also TypeError      bad use of cache_compile(): not a bound method of an
    │   and ValueError)                    nn.Module, a wrapped function, a bad argument, a
    │   └── UnidentifiedPassError          custom pass with no identity to key it by
    ├── GraphBreakError                    Dynamo could not capture the method as one graph
    ├── TorchCompileError                  torch's own compile failed (the backend, Inductor):
    │   (also RuntimeError)                named in one message, the fix to try with it
    ├── InferenceOnlyError                 a call needs autograd on a backend cached for inference
    │                                      only (TorchAir, a bare callable; input requires grad)
    ├── UnsupportedProgramError            the compiled program cannot be replayed without
    │                                      Dynamo (degrades to a live compile, never raised to users)
    ├── RankConfigError (also ValueError)  conflicting rank sources (explicit vs torchrun env)
    ├── CpuTargetError (also ValueError)   an unknown CPU target, or a build for a level this
    │                                      CPU lacks (CACHECOMPILE_CPU_TARGET, --cpu-target)
    ├── BuildError                         cachectl build cannot start or go on: a bad
    │                                      factory, workers that disagree or died
    ├── TorchairUnavailableError           torch_npu / torchair cannot be imported here
    │   (also RuntimeError)
    └── GearMismatchError                  a loaded TorchAir program was compiled for other
        (also RuntimeError)                gears than this call's inputs carry

Outside the tree, deliberately (tests/test_error_tree.py reads this list)::

    CacheFaultWarning (UserWarning)        a cache fault; the call went on with a live compile
    └── UnsupportedTorchWarning            this torch is a release cachecompile is not tested
                                           on, or lacks a private name it needs: caching is
                                           off for the process (plain torch.compile)
    RecompileWarning (UserWarning)         kept for compatibility; no longer emitted (entries
                                           carry Dynamo's guards: a recompile is a variant)
    SignatureLimitWarning (UserWarning)    dynamic=False saw more signatures than the limit
    IgnoredArgumentWarning (UserWarning)   keyword arguments cache_compile does not know (TorchAir
                                           accepts and ignores them; so do we, once warned)
    OutOfGearWarning (UserWarning)         a call whose shape is none of the declared gears
    InferenceOnlyWarning (UserWarning)     an inference-only backend, grad mode on, the module
                                           training with parameters that require grad: outputs
                                           carry no autograd history
    UncachedCallWarning (UserWarning)      model.generate() of cache_compile(model): it calls
                                           the original forward, uncached

    CliError (click.ClickException)        cachectl's one line and exit code, made from the
                                           errors above (cachecompile.cli.common)
    _Vacated                               control flow inside warm/lookup.py; never escapes it
    ChainEnd, Vacated, Unusable            a variant chain's read (warm/chain.py): its end, an
                                           entry quarantined, an entry refused; caught by the
                                           two walkers (warm/lookup.py, warm/frames.py)
    _NotAPath                              control flow inside entry/guard_tree.py
    _Unstorable                            control flow inside backends/bare.py
    _Breaks                                control flow inside cold/capture.py: a trace captured
                                           whole broke; traced again letting it break

Store faults are ``cachecompile.store.errors.StoreError`` subclasses; the integration layer turns them
into a ``CacheFaultWarning`` and a live compile, never a crash.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

logger = logging.getLogger(__name__)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for a warning issued by the caller of this
    function, that names the first frame outside cachecompile and torch: the user's line,
    whatever the depth of the call inside the package (gears, dispatch, probe, compile,
    Dynamo's backend callback)."""
    skip: tuple[str, ...] = (_PACKAGE_DIR,)
    # torch, and the store (cachecompile.store installs from its own top-level folder).
    for name in ("torch", "cachecompile.store"):
        where = getattr(sys.modules.get(name), "__file__", None)
        if where:
            skip += (os.path.dirname(os.path.abspath(where)) + os.sep,)
    level = 1
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


class CacheCompileError(Exception):
    """Base class of cachecompile's own errors."""


class ContractError(CacheCompileError, TypeError, ValueError):
    """cache_compile() was used outside its contract.

    Also a ``ValueError``: TorchAir's ``cache_compile`` raises ``ValueError`` for a
    non-method, so code written against it (``except ValueError``) keeps working; the
    ``TypeError`` base is for this package's first releases.
    """


class UnidentifiedPassError(ContractError):
    """A custom Inductor pass that cannot be keyed by what it does (no ``uuid()``, no code)."""


class GraphBreakError(CacheCompileError):
    """The method does not compile to a single graph (fullgraph)."""

    def __init__(self, message: str, *, filename: str | None = None, lineno: int | None = None,
                 reason: str = "") -> None:
        super().__init__(message)
        self.filename = filename
        self.lineno = lineno
        self.reason = reason


class TorchCompileError(CacheCompileError, RuntimeError):
    """torch's compile of the method failed inside torch (its backend: Inductor, AOTAutograd),
    as plain ``torch.compile`` with the same arguments would: one message naming the method,
    the signature, the last line of torch's error and the argument to try. The whole chain
    is logged at DEBUG (``cachecompile.cold.capture``)."""


class InferenceOnlyError(CacheCompileError):
    """A call that needs autograd reached a cached function whose backend caches
    inference only (TorchAir, a bare backend callable; Inductor and aot_eager cache it)."""


class UnsupportedProgramError(CacheCompileError):
    """The compiled program uses something the Dynamo-free warm path cannot replay."""


class RankConfigError(CacheCompileError, ValueError):
    """Rank information from different sources disagrees."""


class CpuTargetError(CacheCompileError, ValueError):
    """A CPU target that is unknown, or a build for a level this CPU cannot run
    (``cachecompile.key.cpu``)."""


class BuildError(CacheCompileError):
    """The build could not start or go on: a bad factory, workers that disagree or died
    (cachecompile.procs.builders; ``cachectl build`` exits 1)."""


class TorchairUnavailableError(CacheCompileError, RuntimeError):
    """torch_npu / torchair cannot be imported here; says why (cachecompile.backends.torchair).
    Also a ``RuntimeError``, as it was first."""


class GearMismatchError(CacheCompileError, RuntimeError):
    """A loaded TorchAir program was compiled for other gears than this call's inputs
    carry. Also a ``RuntimeError``, as it was first."""


class CacheFaultWarning(UserWarning):
    """A cache fault; the call continued with a live torch.compile."""


class UnsupportedTorchWarning(CacheFaultWarning):
    """Caching is off for the process: torch is outside the tested releases or lacks a
    private name cachecompile needs. cache_compile runs as plain torch.compile."""


class RecompileWarning(UserWarning):
    """No longer emitted: entries carry Dynamo's guards, so a recompile is a new variant,
    not a stale entry. Kept so that existing warning filters still import."""


class SignatureLimitWarning(UserWarning):
    """More static signatures than the configured limit; live torch.compile from now on."""


class IgnoredArgumentWarning(UserWarning):
    """cache_compile() got keyword arguments it does not know; they are ignored."""


class InferenceOnlyWarning(UserWarning):
    """A cached method called in grad mode on a module in training mode whose parameters
    require grad, on a backend that caches inference only: its outputs carry no autograd
    history."""


class UncachedCallWarning(UserWarning):
    """A call that a cached module does not cache: ``model.generate()`` of what
    ``cache_compile(model)`` returned calls the original module's forward."""


class OutOfGearWarning(UserWarning):
    """A call of a method with declared gears whose shape is none of them."""


def fault(message: str) -> None:
    """A cache fault, told to the user once as a ``CacheFaultWarning`` at their own line:
    the call goes on with a live compile (the caller's business), never a crash."""
    warnings.warn(f"cachecompile: {message}", CacheFaultWarning, stacklevel=user_stacklevel())
    logger.debug("cachecompile fault: %s", message)
