"""``cachectl``: the command group, every verb registered on it in one place, and ``main``.

Torch-free: the verbs' modules import the store, click and rich; ``build`` starts worker
processes that import torch and the factory (cachecompile.procs.builders). Exit codes: cachecompile.cli.common.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import click

from cachecompile.errors import CacheCompileError
from cachecompile.store import errors, settings

from . import build, program, remote, store_verbs, torchair
from .common import ERROR_CODES, EXIT_STORE, EXIT_USAGE, CliError


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            out = super().invoke(ctx)
            # Flushed here, so that a reader gone away (below) is met here, not in click's
            # or the interpreter's own flush.
            sys.stdout.flush()
            return out
        except errors.StoreError as e:
            code = next(c for t, c in ERROR_CODES if isinstance(e, t))
            raise CliError(str(e), code) from None
        except CacheCompileError as e:  # a declared signature, a rank, a CPU target
            raise CliError(str(e), EXIT_USAGE) from None
        except BrokenPipeError:
            # The reader went away (`cachectl ls | head -1`): what it read was what it
            # wanted. Quiet, and a success, so `set -o pipefail` scripts go on.
            _quiet_stdout()
            ctx.exit(0)
        except OSError as e:
            raise CliError(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "), EXIT_STORE) from None


def _quiet_stdout() -> None:
    """Send what is left of stdout to /dev/null: the interpreter's final flush of the
    closed pipe would raise BrokenPipeError again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cachecompile", message="%(version)s")
def cli() -> None:
    """Inspect and maintain a cachecompile artifact store."""
    settings.warn_unknown_names()


# The local store.
cli.add_command(store_verbs.ls_cmd)
cli.add_command(store_verbs.show_cmd)
cli.add_command(store_verbs.explain_cmd)
cli.add_command(store_verbs.purge_cmd)
cli.add_command(store_verbs.stats_cmd)
cli.add_command(store_verbs.gc_cmd)
cli.add_command(store_verbs.verify_cmd)
cli.add_command(store_verbs.init_cmd)
# The remote tier and bundles.
cli.add_command(remote.remote_group)
cli.add_command(remote.push_cmd)
cli.add_command(remote.pull_cmd)
cli.add_command(remote.export_cmd)
cli.add_command(remote.import_cmd)
# An entry's program, prebuilding, and TorchAir's own cache.
cli.add_command(program.program_cmd)
cli.add_command(build.build_cmd)
cli.add_command(torchair.import_torchair)


def _one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              line: str | None = None) -> str:
    """A warning as cachectl prints it: its class and message, not the source line that
    warned (``SettingWarning: CACHECOMPILE_MAX_SIZE='garbage': not a size ...``)."""
    return f"cachectl: {category.__name__}: {message}\n"


def main(argv: list[str] | None = None) -> None:
    warnings.formatwarning = _one_line
    cli.main(args=argv, prog_name="cachectl")


if __name__ == "__main__":
    main()
