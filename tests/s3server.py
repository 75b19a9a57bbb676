"""A real S3-protocol server for the tests: moto's standalone server in its own process on
127.0.0.1, reached only through the real client stack (s3fs/botocore over HTTP). boto3 is used
by the tests themselves to look at (or damage) what the server holds, never by ckptfmt."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``with S3Server() as s3:`` starts the server; ``s3.env`` points clients at it.

    ``S3Server(auth=True)``: the server checks every request's credentials and what their IAM
    user's policy allows, as AWS does (moto's IAM enforcement, turned on once the users exist).
    ``s3.env`` and ``s3.client()`` then hold an administrator's keys, and ``s3.user(name,
    actions)`` makes a user allowed only ``actions`` and returns the environment that uses its
    keys."""

    def __init__(self, auth: bool = False) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
        self.auth = auth
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "S3Server":
        server = Path(sys.executable).parent / "moto_server"
        self.proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **self.env})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            except OSError:
                time.sleep(0.1)
                continue
            if self.auth:
                self._enforce()
            return self
        self.__exit__()
        raise RuntimeError("moto_server did not start within 60 s")

    def _enforce(self) -> None:
        """An administrator (every S3 and IAM action) whose keys ``env`` holds from now on, then
        moto's checks turned on for every request after this one (its ``reset-auth`` call)."""
        import urllib.request
        admin = self.user("admin", ["s3:*", "iam:*"])
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=30).read()
        self.env = admin

    def user(self, name: str, actions: list[str],
             resources: "list[str] | tuple[str, ...]" = ("*",)) -> dict[str, str]:
        """An IAM user allowed ``actions`` (``["s3:Get*", "s3:List*"]``: read-only) on
        ``resources`` (every one, or ARNs: ``arn:aws:s3:::bucket/*``); the environment of
        ``env`` with that user's keys instead."""
        import json

        import boto3
        iam = boto3.client("iam", **self._keys(self.env))
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": list(resources)}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {**self.env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def _keys(self, env: dict[str, str]) -> dict[str, str]:
        return {"endpoint_url": self.endpoint, "region_name": "us-east-1",
                "aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self):
        import boto3
        return boto3.client("s3", **self._keys(self.env))

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


class CuttingProxy:
    """A TCP proxy between client and server that cuts every connection once ``cut_after``
    bytes went from client to server, and then refuses new ones (a network partition) until
    ``heal()``. The server keeps running: what it holds is what a cut upload left there."""

    def __init__(self, target_port: int, cut_after: int):
        import threading
        self.target_port, self.cut_after, self.sent, self.cut = target_port, cut_after, 0, False
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def heal(self) -> None:
        with self.lock:
            self.cut, self.cut_after = False, float("inf")

    def _accept(self) -> None:
        import threading
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, pair, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple, upward: bool) -> None:
        try:
            while data := src.recv(65536):
                if upward:
                    with self.lock:
                        self.sent += len(data)
                        if self.sent > self.cut_after:
                            self.cut = True
                if self.cut:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()


class UnconditionalProxy:
    """An HTTP proxy in front of the server that drops ``If-None-Match`` from every request: a
    store that ignores S3's conditional PUT, as some S3-compatible servers do (a create then
    replaces what is there). ``with UnconditionalProxy(port) as proxy:``; ``proxy.endpoint``."""

    def __init__(self, target_port: int):
        import http.client
        import http.server
        import threading

        class Forward(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-none-match", "connection")}
                upstream = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> "UnconditionalProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def fixtures(prefix: str, auth: bool = False):
    """``s3, bucket = fixtures("bkt")`` in a test module: one server per module (environment
    pointed at it while the module runs), and a fresh bucket per test, so tests share the server
    but not its contents. ``auth=True``: the server checks credentials (``S3Server``)."""
    import itertools

    import pytest
    count = itertools.count()

    @pytest.fixture(scope="module")
    def s3():
        with S3Server(auth) as server, pytest.MonkeyPatch.context() as mp:
            for key, value in server.env.items():
                mp.setenv(key, value)
            yield server

    @pytest.fixture
    def bucket(s3):
        return s3.bucket(f"{prefix}{next(count)}")
    return s3, bucket
