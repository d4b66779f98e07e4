"""moto's S3 server with each write made atomic, as S3 makes it: ``python moto_serve.py PORT``.

moto checks a conditional put (``If-None-Match: *``, ``If-Match``) and then stores the
object as two steps, on the thread of each request: two nodes creating one record at
once can both pass the check and both store, which S3 itself never allows. The race tests
judge the product against S3's promise, so this server takes one lock around every write
request. Reads stay concurrent, as on S3.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import moto.server

WRITES = frozenset({"PUT", "POST", "DELETE"})


def atomic_writes(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    lock = threading.Lock()

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("REQUEST_METHOD") not in WRITES:
            return list(app(environ, start_response))
        with lock:
            # The whole body is produced under the lock: moto stores while it answers.
            return list(app(environ, start_response))

    return wrapped


def main() -> None:
    # moto's own main (its arguments, environment and handler, whatever its release),
    # with its app wrapped where it hands it to werkzeug.
    serve = moto.server.run_simple

    def run_simple(host: str, port: int, app: Any, **kw: Any) -> None:
        serve(host, port, atomic_writes(app), **kw)

    moto.server.run_simple = run_simple
    moto.server.main(["-H", "127.0.0.1", "-p", sys.argv[1]])


if __name__ == "__main__":
    main()
