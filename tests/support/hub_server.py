"""A small Hugging Face hub on 127.0.0.1 for the real ``huggingface_hub`` client
(``HF_ENDPOINT`` pointed at it): model repos at pinned commits, from local folders.

It answers what ``snapshot_download`` and ``hf_hub_download`` ask of a repo at a commit hash:

- ``GET /api/models/<org>/<name>/tree/<commit>?recursive=...``: the file list (path, size,
  git oid; large files with their LFS sha256), as the hub's tree API;
- ``HEAD`` / ``GET /<org>/<name>/resolve/<commit>/<path>``: the file, with the headers the
  client reads (``X-Repo-Commit``, ``ETag``/``X-Linked-Etag``, ``Content-Length``).

Anything else is 404 with the hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``). ``requests`` counts the GETs of file contents, by path.
:meth:`HubServer.list_also` is the fault of a hostile hub: its tree names a file the repo does
not hold (a name that climbs out of the snapshot folder).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: Files at least this large are served as LFS files (the hub's rule is by .gitattributes).
LFS_FROM_BYTES = 10 << 20


class HubServer:
    """Serve ``repos``: ``{"org/name": (commit_hash, folder)}``; start with :meth:`start`."""

    def __init__(self, repos: dict[str, tuple[str, Path]]) -> None:
        self.repos = {k: (c, Path(d)) for k, (c, d) in repos.items()}
        self.requests: Counter[str] = Counter()
        self._server: ThreadingHTTPServer | None = None
        self._trees: dict[str, list[dict]] = {}

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def list_also(self, repo: str, path: str, size: int = 1) -> None:
        """The tree of ``repo`` also lists a file ``path`` of ``size`` bytes (until
        :meth:`stop`)."""
        self.files(repo).append({"type": "file", "path": path, "size": size, "oid": "0" * 40})

    def files(self, repo: str) -> list[dict]:
        """The tree entries of ``repo`` (read once: a repo at a commit does not change)."""
        if repo not in self._trees:
            self._trees[repo] = self._tree(repo)
        return self._trees[repo]

    def _tree(self, repo: str) -> list[dict]:
        _, folder = self.repos[repo]
        out = []
        for p in sorted(folder.rglob("*")):
            if not p.is_file():
                continue
            data = p.read_bytes()
            entry = {"type": "file", "path": p.relative_to(folder).as_posix(), "size": len(data),
                     "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if len(data) >= LFS_FROM_BYTES:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 134}
            out.append(entry)
        return out


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _fail(self, code: str, status: int = 404):
            payload = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _repo(self, parts: list[str]):
            repo = "/".join(parts[:2])
            if repo not in hub.repos:
                self._fail("RepoNotFound", 401)
                return None
            return repo

        def _serve(self, body: bool):
            path = unquote(urlsplit(self.path).path).strip("/").split("/")
            if path[:2] == ["api", "models"] and len(path) >= 6 and path[4] == "tree":
                repo = self._repo(path[2:4])
                if repo is None:
                    return
                if path[5] != hub.repos[repo][0]:
                    return self._fail("RevisionNotFound")
                payload = json.dumps(hub.files(repo)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)
                return
            if len(path) >= 5 and path[2] == "resolve":
                repo = self._repo(path[:2])
                if repo is None:
                    return
                commit, folder = hub.repos[repo]
                if path[3] != commit:
                    return self._fail("RevisionNotFound")
                rel = "/".join(path[4:])
                entry = next((f for f in hub.files(repo) if f["path"] == rel), None)
                if entry is None:
                    return self._fail("EntryNotFound")
                data = (folder / rel).read_bytes()
                etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if body:
                    hub.requests[f"{repo}/{rel}"] += 1
                    self.wfile.write(data)
                return
            self._fail("EntryNotFound")

    return Handler
