"""Named CPU targets: which instruction set a backend's native kernels are built for.

``native`` (the default) builds for this very CPU (Inductor's ``-march=native``), so the
key holds the CPU's model name and a digest of every ``/proc/cpuinfo`` flag: right for one
machine, too narrow for a fleet. A named x86-64 level (the psABI's ``x86-64-v2``, ``-v3``,
``-v4``) builds for that level only, so the key holds the level and one image serves
every host that has it. ``CACHECOMPILE_CPU_TARGET`` names one target or a list of
candidates (``x86-64-v4,x86-64-v3``, or ``auto`` for every level): a process looks up
each candidate its CPU supports, best first, and compiles a miss for the best one. A
level the CPU lacks is never looked up, so its kernels are never loaded (a named miss,
never SIGILL).

Torch-free: ``cachectl build`` checks its targets before it imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import platform
from collections.abc import Sequence
from typing import Any

from cachecompile.errors import CpuTargetError
from cachecompile.store import settings

logger = logging.getLogger(__name__)

ENV = settings.CPU_TARGET.name
# Test-only: the CPU flags the target check reads instead of /proc/cpuinfo's, so a test
# can be a CPU that lacks a level. Never set it in production: a process told its CPU has
# flags it lacks loads kernels that die of SIGILL.
TEST_FLAGS_ENV = settings.TEST_CPU_FLAGS.name

NATIVE = "native"
AUTO = "auto"

_V1 = ("cmov", "cx8", "fpu", "fxsr", "mmx", "syscall", "sse", "sse2")
_V2 = _V1 + ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
# /proc/cpuinfo names LZCNT "abm"; OSXSAVE is not listed (the kernel enables XSAVE).
_V3 = _V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclasses.dataclass(frozen=True)
class Level:
    """An instruction-set level: the compiler's ``-march`` name, the CPU flags it needs
    (the x86-64 psABI's definitions, as /proc/cpuinfo names them) and the widest vector
    ISA Inductor may use within it (None: scalar code)."""

    name: str
    machines: tuple[str, ...]
    flags: tuple[str, ...]
    vec: str | None
    simdlen: int | None


# Best first: auto's candidates, in the order a process tries them.
LEVELS: tuple[Level, ...] = (
    Level("x86-64-v4", ("x86_64", "AMD64"), _V4, "avx512", 512),
    Level("x86-64-v3", ("x86_64", "AMD64"), _V3, "avx2", 256),
    Level("x86-64-v2", ("x86_64", "AMD64"), _V2, None, None),
)
BY_NAME = {lv.name: lv for lv in LEVELS}


def _cpuinfo() -> tuple[str, str]:
    model, flags = "unknown", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return model, flags


@functools.cache
def native_identity() -> dict[str, Any]:
    """The CPU features that ``-march=native`` kernels depend on: model and every flag."""
    import xxhash

    model, flags = _cpuinfo()
    return {"machine": platform.machine(), "model": model,
            "flags": xxhash.xxh3_64_hexdigest(" ".join(sorted(flags.split())).encode())}


def cpu_flags() -> frozenset[str]:
    """This CPU's flags as /proc/cpuinfo lists them (or the test-only override)."""
    fake = settings.TEST_CPU_FLAGS.raw()
    if fake is not None:
        _warn_fake(fake)
        return frozenset(fake.split())
    return _real_flags()


@functools.cache
def _warn_fake(fake: str) -> None:
    logger.warning("%s is set: the CPU target check reads these flags, not /proc/cpuinfo's "
                   "(a test setting; kernels for flags this CPU lacks die of SIGILL)",
                   TEST_FLAGS_ENV)


@functools.cache
def _real_flags() -> frozenset[str]:
    return frozenset(_cpuinfo()[1].split())


def lacking(level: Level, flags: frozenset[str], machine: str | None = None) -> list[str]:
    """What this CPU lacks to run ``level``'s code: its missing flags, or the machine."""
    machine = machine or platform.machine()
    if machine not in level.machines:
        return [f"an {level.machines[0]} CPU (this is {machine})"]
    return [f for f in level.flags if f not in flags]


def parse(value: str | None) -> tuple[str, ...]:
    """The candidate targets a ``CACHECOMPILE_CPU_TARGET`` value names, best first as
    given (``auto``: every level, best first). Raises :class:`CpuTargetError` on an
    unknown name."""
    value = (value or "").strip()
    if not value:
        return (NATIVE,)
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        names = [lv.name for lv in LEVELS] if part == AUTO else [part]
        for n in names:
            if n != NATIVE and n not in BY_NAME:
                raise CpuTargetError(
                    f"unknown CPU target {n!r}: expected {NATIVE}, {AUTO} or one of "
                    f"{', '.join(BY_NAME)}")
            if n not in out:
                out.append(n)
    return tuple(out) or (NATIVE,)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which of the candidates this CPU can run, best first, and why not the others."""

    candidates: tuple[str, ...]
    supported: tuple[str, ...]
    lacks: dict[str, list[str]]

    @property
    def build(self) -> str | None:
        """The target a miss compiles for: the best supported candidate (None: none is)."""
        return self.supported[0] if self.supported else None

    def why_none(self) -> str:
        """A named miss: every candidate, with what this CPU lacks for it."""
        return "; ".join(f"this CPU lacks {', '.join(v)} for {k}" for k, v in self.lacks.items())


def plan(candidates: Sequence[str], flags: frozenset[str] | None = None,
         machine: str | None = None) -> Plan:
    """Sort ``candidates`` (as :func:`parse` gives them) by what this CPU supports."""
    flags = cpu_flags() if flags is None else flags
    supported: list[str] = []
    lacks: dict[str, list[str]] = {}
    for name in candidates:
        if name == NATIVE:
            supported.append(name)
            continue
        missing = lacking(BY_NAME[name], flags, machine)
        if missing:
            lacks[name] = missing
        else:
            supported.append(name)
    # Best first whatever order they were given in: native, then the higher levels.
    order = {NATIVE: -1, **{lv.name: i for i, lv in enumerate(LEVELS)}}
    return Plan(tuple(candidates), tuple(sorted(supported, key=order.__getitem__)), lacks)


def from_env() -> Plan:
    """The plan ``CACHECOMPILE_CPU_TARGET`` asks for on this CPU. An unknown name warns
    once, naming the variable, and plans ``native`` (kernels for this CPU, keyed by its
    model and flags: never loaded where they cannot run); ``cachectl build`` refuses it."""
    raw = settings.CPU_TARGET.get()
    try:
        candidates = parse(raw)
    except CpuTargetError as e:
        settings.CPU_TARGET.invalid(raw, str(e))
        candidates = (NATIVE,)
    return plan(candidates)


def require(target: str) -> Level | None:
    """The level to build for, checked against this CPU (None for native). Raises
    :class:`CpuTargetError` naming what the CPU lacks: a build for a level it cannot
    run could not be verified against the live compile, and its kernels would not load."""
    (name,) = parse(target)
    if name == NATIVE:
        return None
    level = BY_NAME[name]
    missing = lacking(level, cpu_flags())
    if missing:
        raise CpuTargetError(f"cannot build for {name}: this CPU lacks {', '.join(missing)}")
    return level


def build_targets(values: Sequence[str]) -> tuple[str, ...]:
    """The targets ``cachectl build --cpu-target`` builds, each checked against this CPU
    (``auto``: every level it supports). Raises :class:`CpuTargetError`."""
    out: list[str] = []
    for value in values:
        for part in (p.strip() for p in value.split(",")):
            if part == AUTO:
                names = list(plan(parse(AUTO)).supported)
            else:
                names = list(parse(part))
                for n in names:
                    require(n)
            out.extend(n for n in names if n not in out)
    return tuple(out)


def factor(level: str | None) -> dict[str, Any]:
    """The key's ``cpu`` factor: the level's name, or for native the model and flags."""
    if level is None or level == NATIVE:
        return native_identity()
    return {"machine": platform.machine(), "target": level}
