"""The names inside an entry: its files and the bytecode's constant placeholder.

Torch-free and import-free, so that the writer (``cold``), the loader (``warm``), the
adapters and ``cachectl program`` share one spelling of each.
"""

from __future__ import annotations

# Dynamo's transformed bytecode for the method, marshalled (entry.codeobj).
BYTECODE_FILE = "bytecode.bin"
# The backend's program, by adapter (backends.inductor / aot_eager, backends.torchair);
# for a bare backend callable (backends.bare), Dynamo's FX graph as Python code.
INDUCTOR_PROGRAM = "program.py"
# That program compiled (marshal, entry.codeobj): a warm process runs it without parsing
# and compiling ~50 kB of source per entry (issue 33). The source stays the truth for
# people (cachectl program) and for an entry without it.
INDUCTOR_PROGRAM_CODE = "program.code"
AOT_EAGER_PROGRAM = "program.py"
TORCHAIR_PROGRAM = "torchair_program.py"
BARE_GRAPH = "dynamo_graph.json"
PROGRAM_FILES = tuple(dict.fromkeys((INDUCTOR_PROGRAM, AOT_EAGER_PROGRAM, TORCHAIR_PROGRAM,
                                     BARE_GRAPH)))
# A training graph's program (backends.joint): its layout under this key of the program's
# record (entry.joint), the backward program's own record under BACKWARD_META and its
# files under BACKWARD_DIR.
JOINT_META = "joint"
BACKWARD_META = "backward"
BACKWARD_DIR = "backward/"
# A bytecode constant marshal cannot hold is stored as this prefix + its index in the
# entry's ``consts`` (entry.codeobj); ``cachectl program`` shows the constant in its place.
CONST_PREFIX = "\x00cachecompile-const\x00"
