"""The tables of environment variables in README.md and docs/usage.md, made from the one
table of settings (``cachecompile/store/settings.py``; tests/store/test_settings.py keeps
them equal).

    python tools/settings_docs.py            # print docs/usage.md's table
    python tools/settings_docs.py --write    # rewrite both blocks in this checkout
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cachecompile.store import settings

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true",
                    help="rewrite the blocks in README.md and docs/usage.md")
    args = ap.parse_args(argv)
    if not args.write:
        sys.stdout.write(settings.markdown_table())
        return 0
    for name, readme in settings.DOCS.items():
        path = REPO / name
        path.write_text(settings.replaced(path.read_text(), readme))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
