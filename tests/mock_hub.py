"""A local Hugging Face Hub-compatible HTTP server for the push tests.

A real threaded HTTP server on 127.0.0.1 (random port) that speaks the part of the Hub API
huggingface_hub 2.4 uses on the upload path of ``g4convert push`` (read from the installed
``huggingface_hub/hf_api.py``, ``_commit_api.py`` and ``lfs.py``):

=======================================================  ==========================================
``GET  /api/whoami-v2``                                  token -> user, orgs, token role
``POST /api/repos/create``                               new repo with the Hub's ``.gitattributes``
``GET  /api/models/{repo}[/revision/{rev}]``             repo info (head ``sha``, siblings)
``POST /api/models/{repo}/branch/{branch}``              new branch from main (or ``startingPoint``)
``GET  /api/models/{repo}/tree/{rev}[/{path}]``          file listing (size, git oid, lfs sha256)
``POST /api/models/{repo}/preupload/{rev}``              upload mode per file: lfs or regular
``POST /api/validate-yaml``                              README front matter check
``POST /{repo}.git/info/lfs/objects/batch``              git-lfs batch API, "basic" transfer
``PUT  /lfs-upload/{repo}/{oid}``                        the upload URL the batch hands out
``POST /lfs-verify/{repo}``                              the verify action
``POST /api/models/{repo}/commit/{rev}``                 ndjson commit (header, file, lfsFile,
                                                         deletedFile, deletedFolder)
``HEAD|GET /{repo}/resolve/{rev}/{path}``                a file (download path of ``hf_hub_download``
                                                         / ``snapshot_download``, read from
                                                         ``file_download.py``): ``X-Repo-Commit``,
                                                         ``ETag`` (git blob id, or the LFS sha256
                                                         with ``X-Linked-Etag`` / ``X-Linked-Size``),
                                                         ``Content-Length``; ``Range: bytes=a-[b]``
                                                         answers 206 with ``Content-Range``
=======================================================  ==========================================

Downloads: ``create_repo(..., gated=True)`` makes a repo whose info and file listing are
public but whose files answer 401 (no token) or 403 (a token without access, ``Repo.granted``
lists users with access) with ``X-Error-Code: GatedRepo``, as the Hub does. Hook:
``fail_downloads`` holds paths whose next GET answers 500 (a download that breaks off).

Everything is kept in memory. The server enforces what the real Hub does and what the
tests rely on: tokens and write access (401/403), ``parentCommit`` (412), and a commit
is refused (422) if an ``lfsFile`` names a blob that was never uploaded, so no branch can
reference a missing shard. Hooks: ``fail_lfs_after = N`` makes every LFS upload after the
N-th successful one fail with ``fail_status`` (a non-retried status, like an expired
pre-signed URL), counters ``lfs_uploads`` / ``lfs_failures`` count what arrived.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# The Hub creates every model repo with a .gitattributes that sends these to LFS (abridged).
DEFAULT_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in (
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.onnx", "*.gguf", "*.msgpack", "*.npy", "*.npz",
    "*.zip", "*.tar.*", "*.model", "*.pkl", "*.joblib", "*tfevents*"))
REGULAR_MAX_BYTES = 10 * 1024 * 1024  # the Hub stores larger files through LFS
_YAML_BLOCK = re.compile(r"^(\s*---(?:\r\n|\r|\n))([\S\s]*?)((?:\r\n|\r|\n)---[ \t]*(\r\n|\n|$))")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclass
class Entry:
    """One file of a commit: regular (``content``) or LFS (``lfs_oid`` = sha256)."""

    size: int
    blob_id: str
    content: bytes | None = None
    lfs_oid: str | None = None

    def as_tree(self, path: str) -> dict:
        d = {"type": "file", "oid": self.blob_id, "size": self.size, "path": path}
        if self.lfs_oid is not None:
            d["lfs"] = {"oid": self.lfs_oid, "size": self.size, "pointerSize": len(lfs_pointer(self.lfs_oid, self.size))}
        return d


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    files: dict[str, Entry]


@dataclass
class Repo:
    repo_id: str
    private: bool
    gated: bool = False
    granted: set[str] = field(default_factory=set)  # users allowed to read a gated repo's files
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # uploaded blobs, by sha256

    def resolve(self, rev: str) -> Commit | None:
        oid = self.branches.get(rev, rev)
        return self.commits.get(oid)


@dataclass
class User:
    name: str
    role: str = "write"  # "write" or "read"
    orgs: tuple[str, ...] = ()


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, body: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.body, self.headers = status, message, code, body, headers or {}


class MockHub:
    """``with MockHub() as hub: ...`` serves on ``hub.url`` until the block ends."""

    def __init__(self):
        self.tokens: dict[str, User] = {}
        self.repos: dict[str, Repo] = {}
        self.lock = threading.RLock()
        self.fail_lfs_after: int | None = None
        self.fail_status = 400
        self.lfs_uploads = 0  # successful LFS PUTs
        self.lfs_failures = 0  # injected failures
        self.requests: list[tuple[str, str]] = []
        self.fail_downloads: set[str] = set()
        self._commit_counter = 0
        self._server: ThreadingHTTPServer | None = None

    # ----------------------------------------------------------------- test API

    def add_token(self, token: str, user: str, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        self.tokens[token] = User(user, role, tuple(orgs))

    def create_repo(self, repo_id: str, *, private: bool = False, gated: bool = False,
                    files: dict[str, bytes] | None = None) -> Repo:
        """A repo with the Hub's initial commit, plus one commit of ``files`` (all regular
        unless they match .gitattributes, then LFS)."""
        with self.lock:
            repo = Repo(repo_id, private, gated)
            ga = DEFAULT_GITATTRIBUTES.encode()
            self._add_commit(repo, "main", None, "initial commit",
                             {".gitattributes": Entry(len(ga), git_blob_id(ga), content=ga)})
            self.repos[repo_id] = repo
            if files:
                self.add_commit(repo_id, files)
            return repo

    def add_commit(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """Commit ``files`` (added or replaced) on ``branch``; returns the new commit's oid."""
        with self.lock:
            repo = self.repos[repo_id]
            tree = dict(repo.resolve(branch).files)
            for path, data in files.items():
                if self._is_lfs(repo, branch, path, len(data), data[:512]):
                    oid = hashlib.sha256(data).hexdigest()
                    repo.lfs[oid] = data
                    tree[path] = Entry(len(data), git_blob_id(lfs_pointer(oid, len(data))), lfs_oid=oid)
                else:
                    tree[path] = Entry(len(data), git_blob_id(data), content=data)
            return self._add_commit(repo, branch, repo.branches[branch], "seed", tree)

    def downloads(self) -> list[str]:
        """Repo-relative paths of every file requested through ``/resolve/`` (HEAD or GET)."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for _, p in self.requests if "/resolve/" in p]

    def files(self, repo_id: str, rev: str = "main") -> dict[str, Entry]:
        return dict(self.repos[repo_id].resolve(rev).files)

    def content(self, repo_id: str, path: str, rev: str = "main") -> bytes:
        repo = self.repos[repo_id]
        e = repo.resolve(rev).files[path]
        return e.content if e.lfs_oid is None else repo.lfs[e.lfs_oid]

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> MockHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> MockHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------- model

    def _add_commit(self, repo: Repo, branch: str, parent: str | None, title: str, files: dict[str, Entry]) -> str:
        self._commit_counter += 1
        h = hashlib.sha1(f"{parent}|{title}|{self._commit_counter}".encode())
        for path in sorted(files):
            h.update(f"{path}:{files[path].blob_id}\n".encode())
        oid = h.hexdigest()
        repo.commits[oid] = Commit(oid, parent, title, dict(files))
        repo.branches[branch] = oid
        return oid

    def _is_lfs(self, repo: Repo, rev: str, path: str, size: int, sample: bytes) -> bool:
        commit = repo.resolve(rev)
        ga = commit.files.get(".gitattributes") if commit else None
        patterns = [line.split()[0] for line in (ga.content.decode() if ga and ga.content else "").splitlines()
                    if "filter=lfs" in line]
        name = path.rsplit("/", 1)[-1]
        return (any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(path, p) for p in patterns)
                or size > REGULAR_MAX_BYTES or b"\0" in sample)

    def user(self, auth: str | None) -> User | None:
        if auth and auth.lower().startswith("bearer "):
            return self.tokens.get(auth[7:].strip())
        return None

    def repo_for_read(self, user: User | None, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._owns(user, repo_id)):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def repo_for_write(self, user: User | None, repo_id: str) -> Repo:
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        repo = self.repo_for_read(user, repo_id)
        if not self._owns(user, repo_id) or user.role != "write":
            raise HubError(403, f"You don't have write access to {repo_id}")
        return repo

    @staticmethod
    def _owns(user: User | None, repo_id: str) -> bool:
        ns = repo_id.split("/", 1)[0]
        return user is not None and (ns == user.name or ns in user.orgs)


class _Handler(BaseHTTPRequestHandler):
    hub: MockHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # ----------------------------------------------------------------- plumbing

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body=None, headers: dict | None = None, ctype="application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body if body is not None else {}).encode()
        headers = dict(headers or {})
        self.send_response(status)
        self.send_header("Content-Type", headers.pop("Content-Type", ctype))
        self.send_header("Content-Length", headers.pop("Content-Length", str(len(data))))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        hub = self.hub
        url = urlsplit(self.path)
        body = self._body()
        with hub.lock:
            hub.requests.append((method, url.path))
        user = hub.user(self.headers.get("Authorization"))
        try:
            status, payload, extra = self._route(method, url.path, parse_qs(url.query), body, user)
        except HubError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send(e.status, e.body if e.body is not None else {"error": e.message}, headers)
            return
        self._send(status, payload, extra)

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    # ----------------------------------------------------------------- routes

    def _route(self, method, path, query, body, user):
        hub = self.hub
        seg = [unquote(s) for s in path.strip("/").split("/")]
        if method == "GET" and path == "/api/whoami-v2":
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            return 200, {"type": "user", "name": user.name, "orgs": [{"name": o} for o in user.orgs],
                         "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": user.role}}}, {}
        if method == "POST" and path == "/api/repos/create":
            return self._create(json.loads(body), user)
        if method == "POST" and path == "/api/validate-yaml":
            content = json.loads(body)["content"]
            m = _YAML_BLOCK.search(content)
            data = yaml.safe_load(m.group(2)) if m else {}
            if not isinstance(data, dict):
                raise HubError(400, "bad metadata", body={"errors": [{"message": "metadata must be a dict"}]})
            return 200, {"errors": [], "warnings": []}, {}
        if method in ("GET", "HEAD") and len(seg) >= 5 and seg[2] == "resolve":
            return self._resolve(f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]), user)
        if len(seg) >= 3 and seg[0] == "api" and seg[1] == "models":
            repo_id = f"{seg[2]}/{seg[3]}"
            rest = seg[4:]
            return self._model_api(method, repo_id, rest, query, body, user)
        if method == "POST" and len(seg) == 6 and seg[1].endswith(".git") and seg[2:] == ["info", "lfs", "objects",
                                                                                            "batch"]:
            return self._lfs_batch(f"{seg[0]}/{seg[1][:-4]}", json.loads(body), user)
        if method == "PUT" and len(seg) == 4 and seg[0] == "lfs-upload":
            return self._lfs_put(f"{seg[1]}/{seg[2]}", seg[3], body, query)
        if method == "POST" and len(seg) == 3 and seg[0] == "lfs-verify":
            repo = hub.repo_for_write(user, f"{seg[1]}/{seg[2]}")
            req = json.loads(body)
            if req["oid"] not in repo.lfs or len(repo.lfs[req["oid"]]) != req["size"]:
                raise HubError(404, "object not found")
            return 200, {}, {}
        raise HubError(404, f"no route {method} {path}")

    def _create(self, req, user):
        hub = self.hub
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        ns = req.get("organization") or user.name
        repo_id = f"{ns}/{req['name']}"
        if user.role != "write" or not hub._owns(user, repo_id):
            raise HubError(403, f'You don\'t have the rights to create a model under the namespace "{ns}"')
        with hub.lock:
            if repo_id in hub.repos:
                raise HubError(409, "You already created this model repo", body={"error": "You already created this "
                                                                                          "model repo",
                                                                                 "url": f"{hub.url}/{repo_id}"})
            hub.create_repo(repo_id, private=req.get("visibility") == "private" or bool(req.get("private")))
        return 200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id}, {}

    def _model_api(self, method, repo_id, rest, query, body, user):
        hub = self.hub
        if method == "GET" and (not rest or rest[0] == "revision"):
            repo = hub.repo_for_read(user, repo_id)
            commit = repo.resolve(rest[1] if rest else "main")
            if commit is None:
                raise HubError(404, "Invalid rev id", "RevisionNotFound")
            return 200, {"id": repo_id, "author": repo_id.split("/")[0], "sha": commit.oid, "private": repo.private,
                         "siblings": [{"rfilename": p} for p in sorted(commit.files)]}, {}
        if method == "POST" and len(rest) == 2 and rest[0] == "branch":
            repo = hub.repo_for_write(user, repo_id)
            req = json.loads(body or b"{}")
            with hub.lock:
                if rest[1] in repo.branches:
                    raise HubError(409, "Reference already exists")
                start = repo.resolve(req.get("startingPoint") or "main")
                repo.branches[rest[1]] = start.oid
            return 200, {}, {}
        if method == "GET" and rest and rest[0] == "tree":
            repo = hub.repo_for_read(user, repo_id)
            commit = repo.resolve(rest[1])
            if commit is None:
                raise HubError(404, "Invalid rev id", "RevisionNotFound")
            return 200, _tree(commit, "/".join(rest[2:]), query.get("recursive", ["False"])[0].lower() == "true"), {}
        if method == "POST" and rest and rest[0] == "preupload":
            repo = hub.repo_for_write(user, repo_id)
            commit = repo.resolve(rest[1])
            if commit is None:
                raise HubError(404, "Invalid rev id", "RevisionNotFound")
            out = []
            for f in json.loads(body)["files"]:
                lfs = hub._is_lfs(repo, rest[1], f["path"], f["size"], base64.b64decode(f["sample"]))
                e = commit.files.get(f["path"])
                oid = None if e is None else (e.lfs_oid if e.lfs_oid is not None else e.blob_id)
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
            return 200, {"files": out, "commitOid": commit.oid}, {}
        if method == "POST" and rest and rest[0] == "commit":
            return self._commit(repo_id, rest[1], body, user)
        raise HubError(404, f"no route {method} /api/models/{repo_id}/{'/'.join(rest)}")

    def _resolve(self, repo_id, rev, path, user):
        hub = self.hub
        repo = hub.repo_for_read(user, repo_id)
        if repo.gated and not hub._owns(user, repo_id) and (user is None or user.name not in repo.granted):
            status = 401 if user is None else 403
            raise HubError(status, f"Access to model {repo_id} is restricted and you are not in the authorized list.",
                           "GatedRepo")
        commit = repo.resolve(rev)
        if commit is None:
            raise HubError(404, "Invalid rev id", "RevisionNotFound")
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": commit.oid})
        data = entry.content if entry.lfs_oid is None else repo.lfs[entry.lfs_oid]
        headers = {"X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   "ETag": f'"{entry.lfs_oid or entry.blob_id}"'}
        if entry.lfs_oid is not None:
            headers.update({"X-Linked-Etag": f'"{entry.lfs_oid}"', "X-Linked-Size": str(len(data))})
        if self.command == "GET" and path in hub.fail_downloads:
            hub.fail_downloads.discard(path)
            raise HubError(500, "injected failure: download interrupted")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m is None:
            return 200, data, headers
        start, end = int(m.group(1)), int(m.group(2) or len(data) - 1)
        if start >= len(data):
            raise HubError(416, "Requested range not satisfiable")
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        return 206, data[start:end + 1], headers

    def _lfs_batch(self, repo_id, req, user):
        hub = self.hub
        repo = hub.repo_for_write(user, repo_id)
        objects = []
        for o in req["objects"]:
            oid, size = o["oid"], o["size"]
            if oid in repo.lfs and len(repo.lfs[oid]) == size:
                objects.append({"oid": oid, "size": size})  # already there: no actions
            else:
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                    "upload": {"href": f"{hub.url}/lfs-upload/{repo_id}/{oid}?size={size}"},
                    "verify": {"href": f"{hub.url}/lfs-verify/{repo_id}", "header": {}}}})
        return 200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"}

    def _lfs_put(self, repo_id, oid, body, query):
        hub = self.hub
        with hub.lock:
            if hub.fail_lfs_after is not None and hub.lfs_uploads >= hub.fail_lfs_after:
                hub.lfs_failures += 1
                raise HubError(hub.fail_status, "injected failure: upload interrupted")
            repo = hub.repos[repo_id]
            if hashlib.sha256(body).hexdigest() != oid or len(body) != int(query["size"][0]):
                raise HubError(400, "content does not match its oid or size")
            repo.lfs[oid] = body
            hub.lfs_uploads += 1
        return 200, {}, {}

    def _commit(self, repo_id, rev, body, user):
        hub = self.hub
        repo = hub.repo_for_write(user, repo_id)
        lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
        header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
        with hub.lock:
            if rev not in repo.branches:
                raise HubError(400, f"Invalid rev id: {rev} is not a branch", "RevisionNotFound")
            head = repo.branches[rev]
            parent = header.get("parentCommit")
            if parent is not None and not head.startswith(parent):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo.commits[head].files)
            for item in lines[1:]:
                key, v = item["key"], item["value"]
                if key == "file":
                    data = base64.b64decode(v["content"])
                    tree[v["path"]] = Entry(len(data), git_blob_id(data), content=data)
                elif key == "lfsFile":
                    blob = repo.lfs.get(v["oid"])
                    if blob is None or ("size" in v and len(blob) != v["size"]):
                        raise HubError(422, f"Your push was rejected: LFS object {v['oid']} of {v['path']} "
                                            "was never uploaded")
                    tree[v["path"]] = Entry(len(blob), git_blob_id(lfs_pointer(v["oid"], len(blob))), lfs_oid=v["oid"])
                elif key == "deletedFile":
                    if tree.pop(v["path"], None) is None:
                        raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = v["path"].rstrip("/") + "/"
                    for p in [p for p in tree if p.startswith(prefix)]:
                        del tree[p]
                else:
                    raise HubError(400, f"unknown commit operation {key}")
            oid = hub._add_commit(repo, rev, head, header.get("summary", ""), tree)
        return 200, {"success": True, "commitOid": oid, "commitUrl": f"{hub.url}/{repo_id}/commit/{oid}",
                     "pullRequestUrl": None}, {}


def _tree(commit: Commit, path: str, recursive: bool) -> list[dict]:
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    out, dirs = [], set()
    for p in sorted(commit.files):
        if not p.startswith(prefix):
            continue
        rel = p[len(prefix):]
        parts = rel.split("/")
        for i in range(1, len(parts)):
            d = prefix + "/".join(parts[:i])
            if (recursive or i == 1) and d not in dirs:
                dirs.add(d)
                out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d})
        if recursive or len(parts) == 1:
            out.append(commit.files[p].as_tree(p))
    return out
