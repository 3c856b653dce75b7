"""``g4convert push``: publish a g4 result to the Hugging Face Hub in one commit, then check
the remote copy file by file against OUT.

Upload protocol (huggingface_hub ``HfApi.preupload_lfs_files`` + ``HfApi.create_commit``):

1. Re-render ``README.md`` (the model card) for the target repo, list OUT's files and check
   each against the Hub's per-file limit and that every shard the index (or manifest) names
   is present -- all before anything is sent.
2. Upload the large (LFS / Xet) files first. They become blobs of the repo but no branch
   points at them, so an interruption here leaves the branch exactly as it was; a rerun
   asks the Hub which blobs it already has and sends only the others.
3. One commit with every file (``parent_commit`` = the head read before the upload, so a
   concurrent push makes it fail instead of interleaving): the branch goes from the old
   state to the complete result in one step and never references a missing shard
   (case P15: unslothai/unsloth #2355, huggingface/datasets #5045). huggingface_hub's
   ``upload_large_folder`` is not used: it commits in several batches, so the branch can
   reference an index before its shards.
4. List the remote tree at the new commit and compare names, sizes and content hashes
   (sha256 of LFS files; git blob ids, i.e. sha1 of the content, of small files) with OUT.

The token comes from ``HF_TOKEN`` or the huggingface_hub login and is never printed or
logged; it is also scrubbed from every error message. Network failures are retried a
bounded number of times; huggingface_hub itself retries each LFS request 5 times. Set
``HF_ENDPOINT`` for another Hub-compatible server (and ``HF_HUB_DISABLE_XET=1`` when that
server has no Xet storage: huggingface_hub then uses the plain LFS protocol).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from g4.convert.card import (
    card_text,
    check_repo_id,
    edited_card,
    g4_version,
    load_conversion_facts,
    repo_files,
    write_card,
    write_facts,
)
from g4.convert.options import MIN_SHARD_BYTES
from g4.core.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, file_sha256, read_safetensors_header
from g4.core.errors import CheckpointError, G4Error
from g4.core.sizes import format_bytes
from g4.exporters.formats import CARD_FILE, EVAL_FILE, FACTS_FILE, VERIFICATION_FILE, check_result
from g4.exporters.neuron_int8 import MANIFEST, Manifest

log = logging.getLogger(__name__)

HUB_MAX_FILE_BYTES = 200 * 10**9
"""Per-file hard limit of the Hugging Face Hub, 200 GB (GB = 10**9 bytes): huggingface/hub-docs
``docs/hub/storage-limits.md`` as of hub-docs PR #2169 (2026-01-20; it was 50 GB before,
huggingface/huggingface_hub PR #3696 followed). Checked before anything is sent;
``--max-file-size`` sets another limit (another Hub-compatible server, or a future change)."""
GITATTRIBUTES = ".gitattributes"  # created by the Hub with every repo; not part of OUT
DEFAULT_ATTEMPTS = 3
DEFAULT_RETRY_WAIT_S = 2.0


class HubError(G4Error):
    """Publishing failed: no token, no access, a refused or failed request, or a remote copy
    that differs from OUT."""


@dataclass
class LocalFile:
    """One file of OUT as it will be stored in the repo. ``size`` in bytes."""

    rel: str  # posix path inside the repo
    path: Path
    size: int
    _sha256: str | None = field(default=None, repr=False)
    _git_sha1: str | None = field(default=None, repr=False)

    @property
    def sha256(self) -> str:
        """Hex sha256 of the content (what the Hub stores as the LFS oid)."""
        if self._sha256 is None:
            self._sha256 = file_sha256(self.path)
        return self._sha256

    @property
    def git_sha1(self) -> str:
        """Git blob id: sha1 of ``b"blob <size>\\0" + content`` (what the Hub lists for small files)."""
        if self._git_sha1 is None:
            h = hashlib.sha1(f"blob {self.size}\0".encode())
            with open(self.path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            self._git_sha1 = h.hexdigest()
        return self._git_sha1


@dataclass
class PushReport:
    """What a push did (or, for a dry run, would do). Sizes in bytes."""

    repo_id: str
    revision: str
    files: list[LocalFile]
    card: str
    dry_run: bool = False
    created: bool = False
    commit_oid: str | None = None
    commit_url: str | None = None
    unchanged: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def local_files(out: str | Path) -> list[LocalFile]:
    """Every file OUT contributes to the repo (hidden files and folders excluded), sorted."""
    out = Path(out)
    return [LocalFile(rel, out / rel, size) for rel, size in repo_files(out, include_card=True)]


def check_complete(out: str | Path, files: list[LocalFile], *, max_file_bytes: int | None = None) -> None:
    """Refuse to publish an incomplete or oversized result.

    Checks: every ``*.safetensors`` file's header and data section are complete;
    OUT has ``g4_conversion.json`` and ``README.md``; every shard named by
    ``model.safetensors.index.json`` and every rank file named by ``manifest.json`` is in
    OUT; no file is larger than ``max_file_bytes`` (None: the Hub's, :data:`HUB_MAX_FILE_BYTES`;
    :func:`check_file_sizes`).

    Raises:
        HubError: naming the first problem.
    """
    out = Path(out)
    facts = load_conversion_facts(out)
    names = {f.rel for f in files}
    needed: list[str] = [CARD_FILE, FACTS_FILE, CONFIG_NAME]
    try:
        if (out / INDEX_NAME).is_file():
            needed += sorted(set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values()))
        elif facts["format"] == "nvfp4":
            needed.append(SINGLE_NAME)
        if facts["format"] == "int8-neuron":
            manifest = Manifest.from_dir(out)
            needed += [MANIFEST, *manifest.rank_files, manifest.host_embedding["file"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HubError(f"{out}: unreadable index or manifest ({type(e).__name__}: {e})") from e
    missing = [n for n in needed if n not in names]
    if missing:
        raise HubError(f"{out}: incomplete result, missing {', '.join(missing)}; nothing was sent")

    for f in files:
        if f.rel.endswith(".safetensors"):
            try:  # a truncated or corrupt shard is never published
                read_safetensors_header(f.path)
            except CheckpointError as e:
                raise HubError(f"{e}; nothing was sent") from e
    check_file_sizes(out, files, max_file_bytes, facts["format"])


def check_file_sizes(out: str | Path, files: list[LocalFile], max_file_bytes: int | None, fmt: str) -> None:
    """Refuse a file larger than the per-file limit: ``max_file_bytes`` (``push --max-file-size``)
    or, when None, the Hub's (:data:`HUB_MAX_FILE_BYTES`).

    The message names the largest file over the limit and whose limit it is (the user's or the
    Hub's), gives sizes in the unit that shows them (:func:`~g4.core.sizes.format_bytes`)
    and says what helps: a larger ``--max-file-size``; a smaller ``--max-shard-size`` only
    when every file over the limit is an NVFP4 weight shard and the limit is one a shard can
    meet (at least :data:`~g4.convert.options.MIN_SHARD_BYTES`); a larger ``--tp`` for an
    int8-neuron rank file over the Hub's limit.

    Raises:
        HubError: ``<file>: <size> is over <which limit> of <size> (<n> files are); <what helps>``.
    """
    limit = HUB_MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes
    over = sorted((f for f in files if f.size > limit), key=lambda f: (-f.size, f.rel))
    if not over:
        return
    f = over[0]
    size, cap = format_bytes(f.size), format_bytes(limit)
    if size == cap:  # rounded alike: the exact figures tell them apart
        size, cap = f"{size} ({f.size:,} bytes)", f"{cap} ({limit:,} bytes)"
    shards = fmt == "nvfp4" and all(x.rel.endswith(".safetensors") for x in over) and limit >= MIN_SHARD_BYTES
    if max_file_bytes is not None:
        whose = f"the per-file limit of {cap} that --max-file-size sets"
        fix = f"raise --max-file-size to at least {format_bytes(f.size)}" + (
            ", or convert again with a smaller --max-shard-size" if shards else "")
    else:
        whose = f"the Hub's per-file limit of {cap}"
        fix = ("convert again with a smaller --max-shard-size" if shards else
               "a rank file holds one TP rank's weights: convert again with a larger --tp"
               if fmt == "int8-neuron" and f.rel.startswith("weights/") else "the Hub stores no file this large")
    more = f" ({len(over)} files are)" if len(over) > 1 else ""
    raise HubError(f"{f.path}: {size} is over {whose}{more}; {fix}")


# --------------------------------------------------------------------------- errors and retries


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "<token>") if token else text


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _status(e: BaseException) -> int | None:
    from huggingface_hub.errors import HfHubHTTPError

    for x in _chain(e):
        if isinstance(x, HfHubHTTPError) and x.response is not None:
            return x.response.status_code
    return None


def _is_network(e: BaseException) -> bool:
    import httpx2  # huggingface_hub's HTTP client; its transport errors reach us unwrapped

    return any(isinstance(x, (httpx2.TransportError, ConnectionError, TimeoutError)) for x in _chain(e))


def _server_message(e: BaseException) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    for x in _chain(e):
        if isinstance(x, HfHubHTTPError):
            msg = x.server_message or ""
            return msg.strip().splitlines()[0] if msg.strip() else ""
    return ""


def _no_xet_storage(e: BaseException) -> bool:
    """Whether ``e`` is a Hub-compatible server without Xet storage answering huggingface_hub's
    Xet token request (``/api/models/<repo>/xet-write-token/<rev>``) with 404: deterministic, not a
    network failure (huggingface_hub reports it as a ConnectionError; huggingface/huggingface_hub
    issue #4786)."""
    return any("xet-" in str(x) and "-token" in str(x) and "404" in str(x) for x in _chain(e))


def _explain(e: BaseException, what: str, repo_id: str, token: str | None, attempts: int) -> HubError:
    """One line for a failed Hub request (the token never appears in it)."""
    status = _status(e)
    server = _server_message(e)
    detail = f" ({server})" if server else ""
    if _no_xet_storage(e):
        import huggingface_hub.constants as hc

        msg = (f"{what}: the Hub at {hc.ENDPOINT} has no Xet storage (404 on its xet token endpoint); "
               "set HF_HUB_DISABLE_XET=1 to upload over LFS")
    elif status == 401:
        msg = f"{what}: the Hub rejected the token (401){detail}; check HF_TOKEN or run `hf auth login`"
    elif status == 403:
        msg = f"{what}: no write access to {repo_id} (403){detail}; use a token with write access to that namespace"
    elif status == 404:
        msg = f"{what}: {repo_id} not found or not visible to this token (404){detail}"
    elif status == 412:
        msg = (f"{what}: the branch of {repo_id} moved while uploading (412){detail}; nothing was committed, "
               "run the push again")
    elif status is not None:
        msg = f"{what}: the Hub answered {status}{detail}"
    elif _is_network(e):
        import httpx2

        net = next((x for x in _chain(e) if isinstance(x, (httpx2.TransportError, ConnectionError, TimeoutError))), e)
        msg = (f"{what}: network failure after {attempts} attempts ({type(net).__name__}: "
               f"{str(net).splitlines()[0] if str(net) else 'no detail'})")
    else:
        msg = f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return HubError(_scrub(msg, token))


def _retrying(fn, what: str, *, attempts: int, wait_s: float, repo_id: str, token: str | None):
    """Call ``fn()``; retry network errors, 429 and 5xx up to ``attempts`` times in all
    (waits ``wait_s``, ``2*wait_s``, ... seconds). Other errors are not retried.

    Raises:
        HubError: one line (see :func:`_explain`).
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except HubError:
            raise
        except Exception as e:
            status = _status(e)
            transient = (_is_network(e) and not _no_xet_storage(e) if status is None
                         else status in (429, 500, 502, 503, 504))
            if not transient or attempt == attempts:
                raise _explain(e, what, repo_id, token, attempt) from None
            log.warning("%s: %s; retry %d of %d in %.0f s", what, _scrub(type(e).__name__, token), attempt,
                        attempts - 1, wait_s * 2 ** (attempt - 1))
            time.sleep(wait_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- push


def push_result(out: str | Path, repo_id: str, *, private: bool = False, revision: str = "main",
                commit_message: str | None = None, dry_run: bool = False, allow_existing: bool = False,
                base_model: str | None = None, max_file_bytes: int | None = None,
                endpoint: str | None = None, token: str | None = None, attempts: int = DEFAULT_ATTEMPTS,
                retry_wait_s: float = DEFAULT_RETRY_WAIT_S, echo=click.echo) -> PushReport:
    """Publish the g4 result in ``out`` to the Hub model repo ``repo_id`` at branch ``revision``.

    Args:
        out: a finished g4 result (``g4_conversion.json``, weights, configs).
        repo_id: ``namespace/name``; created (``private`` or public) when missing.
        revision: the branch; created from ``main`` when missing.
        commit_message: default ``Upload <name> (<format>, g4 <version>)``.
        dry_run: render the card and list the files with their sizes; send nothing, write
            nothing, need no token.
        allow_existing: replace the content of a repo that already holds other files
            (files not in OUT are deleted in the same commit). Without it such a repo is
            refused, unless it holds an earlier push of the same conversion (same
            ``g4_conversion.json``), whose card and verification files may be updated.
        base_model: record this Hub repo id as the card's ``base_model`` (written to OUT).
        max_file_bytes: per-file limit checked before upload (``--max-file-size``); None: the Hub's.
        endpoint: Hub URL (default ``HF_ENDPOINT`` or https://huggingface.co).
        token: default ``HF_TOKEN`` or the huggingface_hub login.
        attempts, retry_wait_s: bounded retries of network errors, 429 and 5xx.
        echo: where progress lines go.

    Returns:
        :class:`PushReport`.

    Raises:
        HubError: no token, no write access, a repo with other content, a network failure
            after the retries, or a remote copy that differs from OUT (names, sizes, hashes).
        CardError: OUT is not a g4 result with a model card facts file.
        G4Error: OUT differs from its format's table (:func:`g4.exporters.formats.check_result`),
            before anything is written or sent.
    """
    out = Path(out)
    check_repo_id(repo_id)
    facts = load_conversion_facts(out)
    if base_model is not None:
        check_repo_id(base_model, what="--base-model")
    notes = []
    if not (base_model or facts.get("base_model") or facts["source"].get("repo_id")):
        notes.append("the card names no base_model (g4 could not tell the source's Hub repo from SRC); "
                     "pass --base-model ORG/NAME to link it")
    if dry_run:
        return _dry_run(out, repo_id, revision, base_model, max_file_bytes, notes, facts)

    files = local_files(out)
    check_complete(out, files, max_file_bytes=max_file_bytes)  # before touching OUT or the network
    check_result(out)  # against its format's table, before anything is written or sent
    token = token or hub_token()
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import RevisionNotFoundError

    api = HfApi(endpoint=endpoint, token=token, library_name="g4", library_version=g4_version())
    kw = dict(attempts=attempts, wait_s=retry_wait_s, repo_id=repo_id, token=token)

    _check_write_token(api, repo_id, kw)
    if base_model is not None:
        facts["base_model"] = base_model
        write_facts(out, facts)
    kept = edited_card(out) is not None
    card = write_card(out, repo_id=repo_id, facts=facts)
    if kept:
        notes.append(f"{CARD_FILE} was edited after g4 wrote it: it is uploaded as it is, not re-rendered")
    files = local_files(out)  # README.md changed
    check_complete(out, files, max_file_bytes=max_file_bytes)

    def head() -> str | None:
        try:
            return api.repo_info(repo_id, revision=revision).sha
        except RevisionNotFoundError:
            return None

    created, old_head = _ensure_repo_and_branch(api, repo_id, revision, private, head, echo, kw)
    remote = _retrying(lambda: _remote_files(api, repo_id, old_head), f"listing {repo_id}@{revision}", **kw)
    deletes = _plan_existing(remote, files, repo_id, revision, allow_existing)

    ops = [CommitOperationAdd(path_in_repo=f.rel, path_or_fileobj=str(f.path)) for f in files]
    for op, f in zip(ops, files):
        op.upload_info.sha256 = bytes.fromhex(f.sha256)  # hashed once here; reused by the upload and the check
    echo(f"uploading {len(files)} files ({format_bytes(sum(f.size for f in files))}) to {repo_id}@{revision}")
    _retrying(lambda: api.preupload_lfs_files(repo_id, additions=ops, revision=revision, free_memory=False),
              f"uploading to {repo_id} (nothing committed; a rerun sends only what the Hub lacks)", **kw)

    message = commit_message or f"Upload {repo_id.split('/', 1)[1]} ({facts['format']}, g4 {facts.get('g4_version')})"
    description = (f"{len(files)} files, {sum(f.size for f in files)} bytes, written by `g4convert push` in one commit "
                   "(shards, index and configs together).")
    operations = ops + [CommitOperationDelete(path_in_repo=p) for p in deletes]
    info = _commit_once(api, repo_id, revision, operations, message, description, old_head, head, attempts,
                        retry_wait_s, kw)
    new_head = info.oid if info is not None else _retrying(head, f"reading {repo_id}@{revision}", **kw)
    unchanged = new_head == old_head
    remote = _retrying(lambda: _remote_files(api, repo_id, new_head), f"listing {repo_id}@{new_head[:12]}", **kw)
    problems = compare_remote(remote, files)
    if problems:
        raise HubError(f"{repo_id}@{new_head[:12]} differs from {out}: {len(problems)} problem(s): "
                       + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    url = info.commit_url if info is not None else None
    return PushReport(repo_id, revision, files, card, created=created, commit_oid=new_head, commit_url=url,
                      unchanged=unchanged, notes=notes)


def _dry_run(out: Path, repo_id: str, revision: str, base_model: str | None, max_file_bytes: int | None,
             notes: list[str], facts: dict) -> PushReport:
    """What a push would send: the card rendered in memory and OUT's files; nothing written."""
    card = edited_card(out)
    if card is not None:
        notes.append(f"{CARD_FILE} was edited after g4 wrote it: a push uploads it as it is, not re-rendered")
    else:
        card = card_text(out, repo_id=repo_id, base_model=base_model, facts=facts)
    files = [f for f in local_files(out) if f.rel != CARD_FILE]
    files = sorted(files + [LocalFile(CARD_FILE, out / CARD_FILE, len(card.encode("utf-8")))], key=lambda f: f.rel)
    check_complete(out, files, max_file_bytes=max_file_bytes)
    check_result(out)
    return PushReport(repo_id, revision, files, card, dry_run=True, notes=notes)


def _check_write_token(api, repo_id: str, kw: dict) -> None:
    who = _retrying(lambda: api.whoami(), "checking the token", **kw)
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HubError(f"the token of {who.get('name')} is read-only; pushing to {repo_id} needs a write token")


def _ensure_repo_and_branch(api, repo_id: str, revision: str, private: bool, head, echo, kw: dict
                            ) -> tuple[bool, str]:
    """Create the repo (``private``, else the namespace's default) and the branch when missing.
    Returns ``(created, head commit of the branch)``."""
    from huggingface_hub.errors import RepositoryNotFoundError

    def exists() -> bool:
        try:
            api.repo_info(repo_id)
            return True
        except RepositoryNotFoundError:
            return False

    created = False
    if not _retrying(exists, f"reading {repo_id}", **kw):
        # private=None (not False) when public: an organisation's default visibility applies.
        _retrying(lambda: api.create_repo(repo_id, private=True if private else None, exist_ok=True),
                  f"creating {repo_id}", **kw)
        created = True
        echo(f"created {'private' if private else 'public'} repo {repo_id}")
    elif private:
        echo(f"{repo_id} exists; its visibility is left as it is")
    old_head = _retrying(head, f"reading {repo_id}@{revision}", **kw)
    if old_head is None:
        _retrying(lambda: api.create_branch(repo_id, branch=revision, exist_ok=True),
                  f"creating branch {revision} of {repo_id}", **kw)
        echo(f"created branch {revision} of {repo_id} from main")
        old_head = _retrying(head, f"reading {repo_id}@{revision}", **kw)
    if old_head is None:
        raise HubError(f"{repo_id}: branch {revision} cannot be read after creating it")
    return created, old_head


def _commit_once(api, repo_id: str, revision: str, operations, message: str, description: str, old_head: str,
                 head, attempts: int, retry_wait_s: float, kw: dict):
    """The one commit on top of ``old_head``, retried on network errors only while the branch has
    not moved. Returns the commit info, or None when a retried request turned out to have landed."""
    for attempt in range(1, attempts + 1):
        try:
            return api.create_commit(repo_id, operations, commit_message=message, commit_description=description,
                                     revision=revision, parent_commit=old_head)
        except Exception as e:
            if not _is_network(e) or _status(e) is not None or attempt == attempts:
                raise _explain(e, f"committing to {repo_id}@{revision}", repo_id, kw["token"], attempt) from None
            # The request may have reached the Hub: if the branch moved, check what is there.
            now = _retrying(head, f"reading {repo_id}@{revision}", **kw)
            if now != old_head:
                return None
            time.sleep(retry_wait_s * 2 ** (attempt - 1))
    return None


def hub_token() -> str:
    """The Hugging Face token huggingface_hub finds (``HF_TOKEN``, then ``hf auth login``'s file).

    Raises:
        HubError: there is none.
    """
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (--dry-run needs none)")
    return token


def _remote_files(api, repo_id: str, revision: str) -> dict:
    from huggingface_hub.hf_api import RepoFile

    return {e.path: e for e in api.list_repo_tree(repo_id, revision=revision, recursive=True)
            if isinstance(e, RepoFile)}


def _same_content(remote_file, local: LocalFile) -> bool:
    if remote_file.size != local.size:
        return False
    if remote_file.lfs is not None:
        return remote_file.lfs.sha256 == local.sha256
    return remote_file.blob_id == local.git_sha1


def compare_remote(remote: dict, files: list[LocalFile]) -> list[str]:
    """Differences between a remote tree (``{path: RepoFile}``) and OUT's files: names,
    sizes, and content hashes (sha256 for LFS files, git blob id for the others).
    ``.gitattributes`` (the Hub's own) is ignored. Returns one phrase per problem."""
    local = {f.rel: f for f in files}
    problems = [f"{p}: missing on the Hub" for p in sorted(set(local) - set(remote))]
    problems += [f"{p}: on the Hub but not in OUT" for p in sorted(set(remote) - set(local) - {GITATTRIBUTES})]
    for p in sorted(set(local) & set(remote)):
        r, f = remote[p], local[p]
        if r.size != f.size:
            problems.append(f"{p}: size {r.size} on the Hub, {f.size} in OUT")
        elif r.lfs is not None and r.lfs.sha256 != f.sha256:
            problems.append(f"{p}: sha256 {r.lfs.sha256[:12]} on the Hub, {f.sha256[:12]} in OUT")
        elif r.lfs is None and r.blob_id != f.git_sha1:
            problems.append(f"{p}: git blob {r.blob_id[:12]} on the Hub, {f.git_sha1[:12]} in OUT")
    return problems


# Files an earlier push of the same conversion may hold in another version: the card is
# re-rendered per push, verification.json and eval.json are added by `g4serve check` and
# `g4convert eval` after conversion.
_UPDATABLE = frozenset({CARD_FILE, VERIFICATION_FILE, EVAL_FILE})


def _plan_existing(remote: dict, files: list[LocalFile], repo_id: str, revision: str, allow_existing: bool) -> list[str]:
    """Decide what to do with files already on the branch; returns the paths to delete.

    Raises:
        HubError: the branch holds other content and ``allow_existing`` is off.
    """
    local = {f.rel: f for f in files}
    others = sorted(set(remote) - set(local) - {GITATTRIBUTES})
    changed = sorted(p for p in set(remote) & set(local) if not _same_content(remote[p], local[p]))
    if not others and not changed:
        return []
    facts = remote.get(FACTS_FILE)
    same_conversion = facts is not None and _same_content(facts, local[FACTS_FILE])
    if allow_existing:
        return others
    if same_conversion and not others and set(changed) <= _UPDATABLE:
        return []
    parts = []
    if others:
        parts.append(f"{len(others)} file(s) not in OUT, e.g. {others[0]}")
    if changed:
        parts.append(f"{len(changed)} file(s) with other content, e.g. {changed[0]}")
    raise HubError(f"{repo_id}@{revision} already holds other content ({'; '.join(parts)}); pass --allow-existing "
                   "to replace it (files not in OUT are deleted in the same commit)")


# --------------------------------------------------------------------------- CLI


def echo_report(report: PushReport, out: Path, echo=click.echo) -> None:
    """Print a push (or dry-run) summary."""
    for note in report.notes:
        echo(f"note: {note}", err=True)
    if report.dry_run:
        echo(f"dry run: would push {out} to {report.repo_id} (branch {report.revision}) in one commit; "
             "nothing is sent")
        width = max(len(f"{f.size:,}") for f in report.files)
        for f in report.files:
            echo(f"  {f.size:>{width},} B  {f.rel}")
        largest = max(report.files, key=lambda f: f.size)
        echo(f"{len(report.files)} files, {report.total_bytes:,} bytes; largest {largest.rel} ({largest.size:,} bytes)")
        echo(f"--- {CARD_FILE} (model card) ---")
        echo(report.card, nl=False)
        return
    where = f"{report.repo_id}@{report.commit_oid[:12] if report.commit_oid else report.revision}"
    if report.unchanged:
        echo(f"{report.repo_id} already held exactly these files; verified {len(report.files)} files at {where}")
    else:
        echo(f"committed {len(report.files)} files ({report.total_bytes:,} bytes) to {report.repo_id} "
             f"branch {report.revision} in one commit{': ' + report.commit_url if report.commit_url else ''}")
        echo(f"verified {where}: names, sizes and hashes of all {len(report.files)} files match {out}")
