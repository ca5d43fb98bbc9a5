"""A local S3 endpoint for tests: moto's server mode (``moto[server]``) on 127.0.0.1, in a
thread of the test process, that can lose its bucket in the middle of a download.

The clients under test (obstore in :mod:`serve_app.common.bucket_fetch`, in this process or
in a Ray replica) reach it through the standard variables :meth:`S3Server.env` returns
(``AWS_ENDPOINT_URL``, keys, region, ``AWS_ALLOW_HTTP``); the test fills buckets with boto3
(:meth:`S3Server.client`).

Faults:

- :meth:`S3Server.vanish_during`: the next GET of an object whose key ends with a given
  suffix sends half of its bytes and drops the connection, and from then on the server
  answers every request ``404 NoSuchBucket``, as if the bucket had been deleted mid-download;
- :meth:`S3Server.replace_during`: the next GET of an object whose key ends with a given
  suffix finds it replaced by other bytes just before it is served, as a writer that
  replaces it between a client's listing and its download would.
"""

from __future__ import annotations

import threading
from pathlib import Path

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                           create_backend_app)
from werkzeug.serving import make_server

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
_NO_BUCKET = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchBucket</Code>'
              b"<Message>The specified bucket does not exist</Message></Error>")


class S3Server(ThreadedMotoServer):
    """moto's threaded server with a fault switch; ``start()`` / ``stop()`` as moto's."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.gone = False
        self._vanish_on: str | None = None
        self._replace_on: tuple[str, bytes] | None = None
        self.vanished = threading.Event()
        self.object_gets: list[str] = []

    @property
    def url(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"

    def env(self) -> dict[str, str]:
        """What a client of this endpoint needs in its environment."""
        return {**KEYS, "AWS_ENDPOINT_URL": self.url, "AWS_ALLOW_HTTP": "true"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name=KEYS["AWS_REGION"],
                            aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"])

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Upload every file of ``folder`` under ``s3://bucket/prefix/`` (the bucket made if
        new); return that URI."""
        s3 = self.client()
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                s3.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder).as_posix()}")
        return f"s3://{bucket}/{prefix}"

    def vanish_during(self, key_suffix: str | None) -> None:
        """Lose every bucket halfway through the next GET of a key ending with
        ``key_suffix`` (None: no fault; also brings the buckets back)."""
        self._vanish_on, self.gone = key_suffix, False
        self.vanished.clear()

    def replace_during(self, key_suffix: str | None, data: bytes = b"") -> None:
        """Replace the object of the next GET of a key ending with ``key_suffix`` with
        ``data`` right before it is served (None: no fault)."""
        self._replace_on = (key_suffix, data) if key_suffix else None

    def _server_entry(self) -> None:  # moto's, with the fault in front of its app
        self._server = make_server(self._ip_address, self._port,
                                   self._faults(DomainDispatcherApplication(create_backend_app)),
                                   True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    def _faults(self, app):
        def wrapped(environ, start_response):
            if self.gone:
                start_response("404 Not Found", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(_NO_BUCKET)))])
                return [_NO_BUCKET]
            path = environ.get("PATH_INFO", "")
            is_get = environ["REQUEST_METHOD"] == "GET" and not environ.get("QUERY_STRING")
            if is_get:
                self.object_gets.append(path)
            if is_get and self._replace_on and path.endswith(self._replace_on[0]):
                data, self._replace_on = self._replace_on[1], None
                bucket, key = path.lstrip("/").split("/", 1)
                self.client().put_object(Bucket=bucket, Key=key, Body=data)
            if not (is_get and self._vanish_on and path.endswith(self._vanish_on)):
                return app(environ, start_response)
            body = b"".join(app(environ, start_response))

            def half_then_gone():
                yield body[:len(body) // 2]
                self.gone = True
                self.vanished.set()
                raise ConnectionAbortedError("the bucket went away mid-download (test fault)")
            return half_then_gone()
        return wrapped
