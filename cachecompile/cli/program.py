"""``cachectl program KEY``: an entry's program, readably (TorchAir's ``readable_cache``).

Prints what a warm process runs for the entry: the guards that decide whether it fits
(in the user's terms; with ``--tree`` as Dynamo's C++ guard tree checks them), the
custom operators its program calls, Dynamo's transformed
bytecode for the method (disassembled, when this Python is the one that wrote it), and
the backend's program (Inductor's output code, the FX code, TorchAir's generated code).

Torch-free: the bytecode is unmarshalled and disassembled, never run; the constants
cachecompile stores beside it are shown from their JSON form.
"""

from __future__ import annotations

import dis
import io
import json
import marshal
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.syntax import Syntax

from cachecompile.entry import guard_paths
from cachecompile.entry.files import BACKWARD_DIR, BYTECODE_FILE, CONST_PREFIX, PROGRAM_FILES
from cachecompile.entry.frame_records import graph_prefix
from cachecompile.entry.meta import EntryMeta

from .common import (
    EXIT_USAGE,
    CliError,
    _console,
    _open_local,
    cache_dir_option,
    frame_summary,
    read_frames,
    read_meta,
)
from .readable import demangle, fold_hooks, ranges

# A placeholder constant as dis prints it: the repr of CONST_PREFIX and its index, e.g.
# '\x00cachecompile-const\x000' (the backslashes are in the text); the index is group 1.
_QUOTED = repr(CONST_PREFIX)
_PLACEHOLDER = re.compile(re.escape(_QUOTED[:-1]) + r"(\d+)" + re.escape(_QUOTED[-1]))


def _python_of(manifest: dict[str, Any]) -> str | None:
    v = manifest.get("factors", {}).get("versions", {}).get("python")
    return str(v) if v else None


def disassemble(data: bytes, consts: list[Any]) -> str:
    """Dynamo's bytecode as ``dis`` prints it, placeholders shown as the stored constant."""
    code = marshal.loads(data)
    if not isinstance(code, types.CodeType):
        raise ValueError("the stored bytecode is not a code object")
    buf = io.StringIO()
    dis.dis(code, file=buf)

    def const(m: re.Match[str]) -> str:
        i = int(m.group(1))
        return f"<{json.dumps(consts[i])}>" if i < len(consts) else m.group(0)

    return _PLACEHOLDER.sub(const, buf.getvalue())


def _guard_lines(guards: list[Any]) -> str:
    """Guards as the reader needs them: Dynamo's generated names as what they hold, and a
    module's hook-dict checks folded into one line per group at its first guard's number,
    naming every guard it stands for (the method's and every frame's alike)."""
    texts = [demangle(str(g.get("text") or g.get("expr") or g.get("kind"))) for g in guards]
    return "\n".join(f"{idx[0]:4d}  {text}" + (f" [{ranges(idx)}]" if len(idx) > 1 else "")
                     for idx, text in fold_hooks(texts))


def _frames(meta: EntryMeta, data_dir: Path, no_bytecode: bool,
            bytecode_text: Callable[[Path, list[Any]], str],
            only: int | None = None) -> list[tuple[str, str, str]]:
    """A graph break's other frames: each one's guards per variant, the continuation's own
    code, each variant's transformed bytecode, and the graphs' programs (``only``: that
    frame and its graphs)."""
    out: list[tuple[str, str, str]] = []
    frames = read_frames(meta)
    graphs: set[int] = set(range(len(meta.graphs))) if only is None else set()
    # Frame 0 is the method's own; a frame variant's entry holds none, its frame is 0.
    for i, r in enumerate(frames, 0 if meta.head else 1):
        if only is not None and i != only:
            continue
        out.append((f"frame {i}: {frame_summary(r)}", f"module {r.module}", "text"))
        if r.kind == "resume" and r.code and not no_bytecode:
            out.append((f"frame {i}: the continuation Dynamo generated (run as written where "
                        "no variant serves)",
                        bytecode_text(data_dir / r.code, list(r.code_consts)), "text"))
        for j, v in enumerate(r.variants):
            graphs |= set(v.graphs.values())
            out.append((f"frame {i} variant {j}: guards ({len(v.guards)})",
                        _guard_lines(list(v.guards)) or "(none)", "text"))
            if not no_bytecode:
                calls = ", ".join([*(f"{n} (graph {g})" for n, g in v.graphs.items()),
                                   *v.resumes])
                out.append((f"frame {i} variant {j}: Dynamo's transformed bytecode (calls "
                            f"{calls or 'nothing of ours'})",
                            bytecode_text(data_dir / v.bytecode, list(v.consts)), "text"))
    for g in sorted(graphs):
        out.extend(_programs(data_dir / graph_prefix(g), f"graph {g}: "))
    return out


def _programs(folder: Path, title: str) -> list[tuple[str, str, str]]:
    """A graph's program files; a training graph's backward program after its forward."""
    out: list[tuple[str, str, str]] = []
    for sub, what in (("", ""), (BACKWARD_DIR, " (the backward of a training graph)")):
        for name in PROGRAM_FILES:
            path = folder / sub / name
            if path.is_file():
                out.append((f"{title}{sub}{name}{what}",
                            path.read_text(encoding="utf-8", errors="replace"), "python"))
    return out


@click.command("program", short_help="Print an entry's guards, bytecode and program")
@cache_dir_option
@click.argument("key")
@click.option("--no-bytecode", is_flag=True, help="Leave out Dynamo's bytecode.")
@click.option("--tree", is_flag=True,
              help="Show the guards as Dynamo's C++ guard tree checks them on every call: "
                   "each object path once, with its leaves; then what runs in Python. "
                   "Leaves a module's unchanged dicts decide are skipped until one changes.")
@click.option("--frame", "frame", type=click.IntRange(min=0), default=None, metavar="N",
              help="Only frame N of a graph break (0: the method's own frame; `show` "
                   "numbers them): its guards, bytecode and graphs.")
def program_cmd(cache_dir: str | None, key: str, no_bytecode: bool, tree: bool,
                frame: int | None) -> None:
    """Print an entry's guards, bytecode and program readably (KEY may be a prefix)."""
    st = _open_local(cache_dir)
    digest = st.resolve(key)
    m = st.manifest(digest)
    meta = read_meta(m)
    labels = m.get("labels", {})
    data_dir = st.entry_dir(digest) / "data"
    out: list[tuple[str, str, str]] = []   # (title, text, lexer)
    head = [f"entry     {digest}",
            f"method    {labels.get('model', '?')}.{labels.get('function', '?')}",
            f"signature {labels.get('signature', meta.signature or '?')}",
            f"backend   {labels.get('backend', meta.adapter or '?')}",
            f"python    {_python_of(m) or '?'}"]
    ops = meta.program.get("operators") or []
    if ops:
        head.append(f"operators {', '.join(ops)} (must be registered in a warm process)")
    out.append(("entry", "\n".join(head), "text"))
    written = _python_of(m) or "?"
    same_python = written.split()[-1].split(".")[:2] == [str(v) for v in sys.version_info[:2]]

    def bytecode_text(path: Path, consts: list[Any]) -> str:
        if not same_python:
            return (f"(written by {written}; this is Python {sys.version.split()[0]}, "
                    "whose marshal and dis cannot read it)")
        try:
            return disassemble(path.read_bytes(), consts)
        except (OSError, ValueError, EOFError, TypeError) as e:
            return f"(does not load: {e})"

    numbers = {0, *(i for i, _ in enumerate(read_frames(meta), 0 if meta.head else 1))}
    if frame is not None and frame not in numbers:
        raise CliError(f"entry {digest[:12]} has no frame {frame}: its frames are "
                       f"{', '.join(map(str, sorted(numbers)))}", EXIT_USAGE)
    if frame in (None, 0):
        out.extend(_own_frame(meta, data_dir, tree, no_bytecode, bytecode_text))
    if frame != 0:
        out.extend(_frames(meta, data_dir, no_bytecode, bytecode_text, frame))
    _print(out)


def _own_frame(meta: EntryMeta, data_dir: Path, tree: bool, no_bytecode: bool,
               bytecode_text: Callable[[Path, list[Any]], str]) -> list[tuple[str, str, str]]:
    """The method's own frame: its guards (and tree), its bytecode, its program."""
    out: list[tuple[str, str, str]] = []
    guards = list(meta.guards)
    if guards:
        out.append((f"guards ({len(guards)}): the entry fits a call when all hold",
                    _guard_lines(guards), "text"))
        if tree:
            out.append(("the guard tree a warm process checks on every call (guards=always; "
                        "leaves the identity of a module's dict-held state decides are "
                        "skipped while those dicts are unchanged)",
                        guard_paths.render(guards), "text"))
    bytecode = data_dir / BYTECODE_FILE
    if not no_bytecode and bytecode.is_file():
        calls = ", ".join([meta.compiled_fn] * bool(meta.compiled_fn) + list(meta.resumes))
        out.append((f"Dynamo's transformed bytecode (calls {calls or 'nothing of ours'})",
                    bytecode_text(bytecode, list(meta.consts)), "text"))
    out.extend(_programs(data_dir, ""))
    return out


def _print(out: list[tuple[str, str, str]]) -> None:
    con = _console()
    tty = sys.stdout.isatty()
    for title, text, lexer in out:
        if tty:
            con.rule(title)
            con.print(Syntax(text, lexer, word_wrap=False) if lexer == "python" else text,
                      markup=False, highlight=False)
        else:
            click.echo(f"# ---- {title}")
            click.echo(text.rstrip("\n"))
