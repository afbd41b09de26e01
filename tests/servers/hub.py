"""A local server speaking the part of the Hugging Face Hub HTTP API huggingface_hub uses.

Enough for ``HfApi.dataset_info`` and ``HfApi.model_info`` (one namespace of repos
serves both), ``HfApi.list_repo_tree`` (cursor pagination via the
``Link`` header, like the Hub) and ``hf_hub_download`` / streaming downloads
(``HEAD``/``GET /datasets/{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``,
``ETag``, ``X-Linked-Etag``, ``X-Linked-Size`` and ``Range``). Files ending in
``.pt``, ``.parquet`` or ``.arrow`` are served as LFS files (sha256 etag), others as git
blobs. Run huggingface_hub against it with ``HF_ENDPOINT=<server.url>``.

Uploads: ``HfApi.create_commit`` through the LFS protocol (set ``HF_HUB_DISABLE_XET=1``,
or ``huggingface_hub.constants.HF_HUB_DISABLE_XET = True`` in-process: the Xet protocol's
token and CAS endpoints are not served). That is ``POST .../preupload/{rev}`` (upload mode
by suffix as above, and the ``oid`` of the file already at that path, so unchanged files
are left out of a commit), the LFS batch endpoint (``POST /datasets/{repo}.git/info/lfs/
objects/batch``: an upload action only for content not stored yet), the basic transfer
(``PUT`` of the body, checked against its sha256) and ``POST .../commit/{rev}`` (NDJSON:
``file`` (base64), ``lfsFile``, ``deletedFile``, ``deletedFolder``; ``parentCommit`` is
honoured). A commit moves the branch to a new commit holding the parent's files plus the
changes; nothing else (no PRs, no copies, no multipart).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tests.servers.loopback import LoopbackServer

__all__ = ["FakeHub"]

_LFS_SUFFIXES = (".pt", ".parquet", ".bin", ".safetensors", ".arrow")


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub(LoopbackServer):
    """Serves dataset repos from memory. Thread-safe.

    Args:
        page_size: tree entries per page (small, to exercise pagination).
    """

    def __init__(self, page_size: int = 3):
        self.page_size = page_size
        self._repos: dict[str, dict] = {}
        self._lfs: dict[str, bytes] = {}  # uploaded LFS objects by sha256
        self._lock = threading.Lock()
        self.log: list[tuple[str, str]] = []
        super().__init__(self._handler_class())

    def add_commit(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """Add a commit holding exactly ``files`` (path -> bytes); return its hash."""
        sha = hashlib.sha1(
            repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())).encode()
        )
        commit = sha.hexdigest()
        with self._lock:
            repo = self._repos.setdefault(repo_id, {"commits": {}, "refs": {}})
            repo["commits"][commit] = dict(files)
            repo["refs"][branch] = commit
        return commit

    def add_folder(
        self, repo_id: str, folder: Path, *, prefix: str = "", branch: str = "main", extra=None
    ) -> str:
        files = {
            f"{prefix}{p.name}" if prefix else p.name: p.read_bytes()
            for p in folder.iterdir()
            if p.is_file()
        }
        files.update(extra or {})
        return self.add_commit(repo_id, files, branch=branch)

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """The files of ``rev`` of ``repo_id`` (a copy)."""
        with self._lock:
            got = self._resolve(repo_id, rev)
        if got is None:
            raise KeyError(f"{repo_id}@{rev}")
        return dict(got[1])

    def count(self, match: str, method: str = "GET") -> int:
        with self._lock:
            return sum(1 for m, p in self.log if m == method and match in p)

    thread_name = "fake-hub"

    # -- request handling
    def _resolve(self, repo_id: str, rev: str) -> tuple[str, dict] | None:
        repo = self._repos.get(repo_id)
        if repo is None:
            return None
        commit = repo["refs"].get(rev, rev)
        files = repo["commits"].get(commit)
        return (commit, files) if files is not None else None

    def _entry(self, path: str, data: bytes) -> dict:
        e = {"type": "file", "oid": _git_sha1(data), "size": len(data), "path": path}
        if path.endswith(_LFS_SUFFIXES):
            e["lfs"] = {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        return e

    def _tree(self, files: dict[str, bytes], folder: str, recursive: bool) -> list[dict]:
        prefix = f"{folder}/" if folder else ""
        out, dirs = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/", 1)[0])
                continue
            out.append(self._entry(path, files[path]))
        out.extend({"type": "directory", "oid": "0" * 40, "path": d} for d in sorted(dirs))
        return sorted(out, key=lambda e: e["path"])

    def _handler_class(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

            def _json(self, status: int, obj, headers: dict | None = None):
                h = {"Content-Type": "application/json", **(headers or {})}
                self._send(status, json.dumps(obj).encode(), h)

            def _not_found(self, code: str, msg: str, commit: str | None = None):
                h = {"X-Error-Code": code, "X-Error-Message": msg}
                if commit:
                    h["X-Repo-Commit"] = commit
                self._json(404, {"error": msg}, h)

            def do_GET(self):
                parts = urlsplit(self.path)
                with hub._lock:
                    hub.log.append((self.command, unquote(parts.path)))
                segs = parts.path.split("/")  # quoted segments: revision may hold %2F
                q = parse_qs(parts.query)
                # /api/{datasets,models}/{org}/{name}/revision/{rev}
                if (
                    len(segs) >= 7
                    and segs[1] == "api"
                    and segs[2] in ("datasets", "models")
                    and segs[5] == "revision"
                ):
                    repo_id, rev = f"{segs[3]}/{segs[4]}", unquote(segs[6])
                    got = hub._resolve(repo_id, rev)
                    if got is None:
                        return self._not_found("RevisionNotFound", f"Invalid rev id: {rev}")
                    commit, files = got
                    return self._json(
                        200,
                        {
                            "id": repo_id,
                            "sha": commit,
                            "private": False,
                            "siblings": [{"rfilename": p} for p in sorted(files)],
                        },
                    )
                # /api/datasets/{org}/{name}/tree/{rev}[/{path}]
                if (
                    len(segs) >= 7
                    and segs[1] == "api"
                    and segs[2] == "datasets"
                    and segs[5] == "tree"
                ):
                    repo_id, rev = f"{segs[3]}/{segs[4]}", unquote(segs[6])
                    folder = unquote("/".join(segs[7:])).strip("/")
                    got = hub._resolve(repo_id, rev)
                    if got is None:
                        return self._not_found("RevisionNotFound", f"Invalid rev id: {rev}")
                    commit, files = got
                    recursive = q.get("recursive", ["false"])[0].lower() == "true"
                    entries = hub._tree(files, folder, recursive)
                    if folder and not entries:
                        return self._not_found("EntryNotFound", f"{folder} does not exist", commit)
                    cursor = int(q.get("cursor", ["0"])[0])
                    page = entries[cursor : cursor + hub.page_size]
                    headers = {}
                    if cursor + hub.page_size < len(entries):
                        nxt = dict(q)
                        nxt["cursor"] = [str(cursor + hub.page_size)]
                        query = "&".join(f"{k}={quote(v[0])}" for k, v in nxt.items())
                        headers["Link"] = f'<{hub.url}{parts.path}?{query}>; rel="next"'
                    return self._json(200, page, headers)
                # /datasets/{org}/{name}/resolve/{rev}/{path}
                if len(segs) >= 6 and segs[1] == "datasets" and segs[4] == "resolve":
                    return self._resolve_file(segs)
                self._not_found("RepoNotFound", f"no route {parts.path}")

            do_HEAD = do_GET

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()  # the CRLF after each chunk
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_PUT(self):
                parts = urlsplit(self.path)
                with hub._lock:
                    hub.log.append((self.command, unquote(parts.path)))
                body = self._body()
                segs = parts.path.split("/")
                # /_lfs/{oid}: the basic LFS transfer's upload URL
                if len(segs) == 3 and segs[1] == "_lfs":
                    oid = segs[2]
                    if hashlib.sha256(body).hexdigest() != oid:
                        return self._json(400, {"error": f"body does not hash to {oid}"})
                    with hub._lock:
                        hub._lfs[oid] = body
                    return self._send(200)
                self._not_found("RepoNotFound", f"no route {parts.path}")

            def do_POST(self):
                parts = urlsplit(self.path)
                with hub._lock:
                    hub.log.append((self.command, unquote(parts.path)))
                body = self._body()
                segs = parts.path.split("/")
                # /datasets/{org}/{name}.git/info/lfs/objects/batch
                if parts.path.endswith(".git/info/lfs/objects/batch") and segs[1] == "datasets":
                    return self._lfs_batch(json.loads(body))
                # /api/datasets/{org}/{name}/{preupload,commit}/{rev}
                if len(segs) == 7 and segs[1] == "api" and segs[2] == "datasets":
                    repo_id, rev = f"{segs[3]}/{segs[4]}", unquote(segs[6])
                    with hub._lock:
                        got = hub._resolve(repo_id, rev)
                    if got is None:
                        return self._not_found("RevisionNotFound", f"Invalid rev id: {rev}")
                    if segs[5] == "preupload":
                        return self._preupload(got[1], json.loads(body))
                    if segs[5] == "commit":
                        return self._commit(repo_id, rev, got[0], body)
                self._not_found("RepoNotFound", f"no route {parts.path}")

            def _lfs_batch(self, req: dict):
                objects = []
                for obj in req.get("objects", []):
                    oid, size = obj["oid"], int(obj["size"])
                    out = {"oid": oid, "size": size}
                    with hub._lock:
                        stored = oid in hub._lfs
                    if not stored:
                        out["actions"] = {"upload": {"href": f"{hub.url}/_lfs/{oid}"}}
                    objects.append(out)
                self._json(200, {"transfer": "basic", "objects": objects})

            def _preupload(self, files: dict[str, bytes], req: dict):
                out = []
                for f in req.get("files", []):
                    path = f["path"]
                    lfs = path.endswith(_LFS_SUFFIXES) and int(f.get("size", 0)) > 0
                    entry = {
                        "path": path,
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                    }
                    if path in files:
                        have = hub._entry(path, files[path])
                        # huggingface_hub compares it with the local sha256 (LFS) or git
                        # sha1 (regular) and leaves unchanged files out of the commit.
                        entry["oid"] = have["lfs"]["oid"] if lfs and "lfs" in have else have["oid"]
                    out.append(entry)
                self._json(200, {"files": out})

            def _commit(self, repo_id: str, rev: str, head: str, body: bytes):
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                if not lines or lines[0].get("key") != "header":
                    return self._json(400, {"error": "the first line must be the header"})
                parent = lines[0]["value"].get("parentCommit")
                if parent and parent != head:
                    return self._json(412, {"error": f"{rev} is at {head}, not {parent}"})
                with hub._lock:
                    files = dict(hub._repos[repo_id]["commits"][head])
                    for item in lines[1:]:
                        key, value = item["key"], item["value"]
                        path = value["path"]
                        if key == "file":
                            files[path] = base64.b64decode(value["content"])
                        elif key == "lfsFile":
                            data = hub._lfs.get(value["oid"])
                            if data is None:
                                return self._json(
                                    422, {"error": f"LFS object {value['oid']} was never uploaded"}
                                )
                            files[path] = data
                        elif key == "deletedFile":
                            files.pop(path, None)
                        elif key == "deletedFolder":
                            prefix = path.rstrip("/") + "/"
                            files = {p: d for p, d in files.items() if not p.startswith(prefix)}
                        else:
                            return self._json(400, {"error": f"unsupported operation {key!r}"})
                commit = hub.add_commit(repo_id, files, branch=rev)
                self._json(
                    200,
                    {
                        "commitUrl": f"{hub.url}/datasets/{repo_id}/commit/{commit}",
                        "commitOid": commit,
                        "pullRequestUrl": None,
                    },
                )

            def _resolve_file(self, segs):
                repo_id, rev = f"{segs[2]}/{segs[3]}", unquote(segs[5])
                path = unquote("/".join(segs[6:]))
                got = hub._resolve(repo_id, rev)
                if got is None:
                    return self._not_found("RevisionNotFound", f"Invalid rev id: {rev}")
                commit, files = got
                if path not in files:
                    return self._not_found("EntryNotFound", f"{path} does not exist", commit)
                data = files[path]
                entry = hub._entry(path, data)
                etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                headers = {
                    "X-Repo-Commit": commit,
                    "ETag": f'"{etag}"',
                    "Accept-Ranges": "bytes",
                    "Content-Type": "application/octet-stream",
                }
                if "lfs" in entry:
                    headers["X-Linked-Etag"] = f'"{etag}"'
                    headers["X-Linked-Size"] = str(len(data))
                status, body = 200, data
                rng = self.headers.get("Range")
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
                if m:
                    start = int(m.group(1))
                    end = int(m.group(2)) if m.group(2) else len(data) - 1
                    if start >= len(data):
                        return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                    body = data[start : end + 1]
                    status = 206
                    headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{len(data)}"
                headers["Content-Length"] = str(len(body))
                self._send(status, body, headers)

        return Handler
