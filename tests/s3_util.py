"""A real S3-compatible server for tests: moto's server mode on a free loopback port.

``moto_server`` speaks the S3 API over HTTP, refuses a conditional put that does not hold
with 412 (``moto_serve.py`` makes each write atomic, as S3 does), and (with
``auth=True``) enforces IAM policies, so a user whose policy allows only reads gets a real
403 on every write. The test extras install it (``moto[s3]``,
``flask`` and ``flask-cors``: what its server mode needs for S3 and IAM); without it the
S3 tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_util import ServerProcess

SKIP_REASON = ("moto's server (moto[s3], flask, flask-cors) or obstore is not installed: "
               "pip install -e '.[test]' to run the S3-tier tests")
# Any keys do before auth is on; these are the admin's for the setup calls.
ADMIN = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def available() -> bool:
    try:
        import moto.server  # noqa: F401
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


class MotoServer(ServerProcess):
    """One moto_server process; ``kill()`` it (SIGKILL) to simulate a crash."""

    def __init__(self, workdir: Path, *, auth_after: int | None = None) -> None:
        if not available():
            pytest.skip(SKIP_REASON)
        super().__init__(workdir, "moto_server", "moto.log")
        self.auth_after = auth_after

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, keys: dict[str, str] | None = None) -> dict[str, str]:
        """The AWS variables a node uses to reach this server (admin keys by default)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                **(keys or ADMIN)}

    def start(self) -> MotoServer:
        env = dict(os.environ)
        if self.auth_after is not None:
            # IAM enforced after this many requests: the setup calls go first.
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self.auth_after)
        log = open(self.log_file, "ab")  # the server keeps it
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("moto_serve.py")), str(self.port)],
            stdout=log, stderr=log, env=env)
        log.close()

        def answers() -> bool:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=0.5):
                return True

        self.wait_up(answers, timeout=30)
        return self

    def client(self, service: str = "s3", keys: dict[str, str] | None = None) -> Any:
        import boto3

        k = keys or ADMIN
        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=k["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=k["AWS_SECRET_ACCESS_KEY"])

    def bucket(self) -> str:
        """A new, empty bucket (names need 3+ characters)."""
        name = f"cc-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def user(self, name: str, bucket: str, actions: list[str]) -> dict[str, str]:
        """An IAM user allowed only ``actions`` on ``bucket``; its AWS_* keys."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="cc", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{
                "Effect": "Allow", "Action": actions,
                "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}))
        k = iam.create_access_key(UserName=name)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": k["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": k["SecretAccessKey"]}

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix``: key -> size."""
        out: dict[str, int] = {}
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                         Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", []):
                out[o["Key"]] = int(o["Size"])
        return out


# s3rver (npm): a second S3 server, unlike moto in the ways that matter here: it accepts
# a conditional put that does not hold (no 412), checks no signature, and answers a LIST
# of more than 1000 keys with 500. .ci/system-deps.sh installs it where this looks.
S3RVER_VERSION = "3.7.1"
S3RVER_DIR = Path(__file__).resolve().parent.parent / ".s3rver"
S3RVER_SKIP = (f"s3rver is not installed: npm install --prefix .s3rver s3rver@{S3RVER_VERSION} "
               "(as .ci/system-deps.sh does), or point CACHECOMPILE_TEST_S3RVER at its "
               "bin/s3rver.js")
# s3rver knows one key pair; it checks the key id, not the signature.
S3RVER_KEYS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"}


def s3rver_script() -> Path | None:
    given = os.environ.get("CACHECOMPILE_TEST_S3RVER")
    path = Path(given) if given else S3RVER_DIR / "node_modules" / "s3rver" / "bin" / "s3rver.js"
    return path if path.is_file() and shutil.which("node") else None


class S3rver(ServerProcess):
    """One s3rver process on a free loopback port, with one bucket made at start."""

    def __init__(self, workdir: Path, bucket: str = "cc-s3rver") -> None:
        script = s3rver_script()
        if not available():
            # A venv without the S3 library (the Python matrix's) skips the S3 tests, as
            # it always did, whatever CI says of s3rver.
            pytest.skip(SKIP_REASON)
        if script is None:
            # CI installs s3rver (.ci/system-deps.sh): there its absence fails.
            if os.environ.get("CACHECOMPILE_REQUIRE_S3RVER"):
                pytest.fail(f"CACHECOMPILE_REQUIRE_S3RVER is set (CI): {S3RVER_SKIP}")
            pytest.skip(S3RVER_SKIP)
        super().__init__(workdir, "s3rver", "s3rver.log")
        self.script = script
        self.bucket = bucket

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1", **S3RVER_KEYS}

    def start(self) -> S3rver:
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [shutil.which("node") or "node", str(self.script), "-d", str(self.dir / "data"),
             "-a", "127.0.0.1", "-p", str(self.port), "--silent",
             "--configure-bucket", self.bucket], stdout=log, stderr=log)
        log.close()

        def answers() -> bool:
            try:
                urllib.request.urlopen(f"{self.endpoint}/{self.bucket}", timeout=0.5)
            except urllib.error.HTTPError:
                pass  # 403 (no signature) is an answer: the server is up
            return True

        self.wait_up(answers, timeout=30)
        return self

    def store(self, prefix: str) -> Any:
        """An obstore client on the bucket under ``prefix``, for setting objects up."""
        from obstore.store import S3Store

        return S3Store(self.bucket, prefix=prefix, endpoint=self.endpoint,
                       region="us-east-1", access_key_id="S3RVER",
                       secret_access_key="S3RVER", client_options={"allow_http": True})


@contextlib.contextmanager
def running(workdir: Path, **kw: Any) -> Iterator[MotoServer]:
    srv = MotoServer(workdir, **kw).start()
    try:
        yield srv
    finally:
        srv.stop()
