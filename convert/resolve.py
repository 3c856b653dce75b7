"""SRC as every command takes it: a local checkpoint directory, ``embedded``, or a Hub repo id.

:func:`resolve_source` turns the text into a local directory, in this order:

1. ``embedded``: the tiny Gemma 4 that ships in the package;
2. an existing local path (a directory, or for ``g4convert plan`` a ``config.json``), even
   when it also reads as ``owner/name``;
3. ``owner/name`` or ``owner/name@revision`` (branch, tag or commit): a Hugging Face Hub
   model repo, through huggingface_hub's cache (``HF_HUB_CACHE`` / ``HF_HOME``).
   ``snapshot_download`` asks the Hub which commit the revision is and fetches only what the
   cache lacks, resuming partial files, with huggingface_hub's progress bar; with
   ``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached, the cached snapshot is used as it
   is. Only the files g4 reads are fetched (:data:`g4.core.checkpoint.SOURCE_META_FILES`
   top-level only, and exactly the safetensors shards the index names): never pickles, other
   weight formats or sub-folders such as ``original/``;
4. anything else is returned as a path, and the command reports that it does not exist.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from pathlib import Path

from g4.core.checkpoint import CONFIG_NAME, SOURCE_META_FILES, SRC_FORMS, refuse_quantized, weight_files
from g4.core.errors import G4Error, OptionError

EMBEDDED_DIR = Path(__file__).parent / "embedded"
"""The embedded tiny Gemma 4 (``SRC`` ``embedded``; trained by ``g4.convert.embedded_model``)."""

EMBEDDED = "embedded"
EMBEDDED_OUT_NAME = "gemma4-tiny"
REPO_ID_PATTERN = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_REPO_REF = re.compile(rf"^(?P<repo>{REPO_ID_PATTERN})(?:@(?P<rev>[^@\s]+))?$")
_LOGIN = "log in with `hf auth login` or set HF_TOKEN"

log = logging.getLogger(__name__)


def parse_repo_ref(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` when ``text`` is ``owner/name[@revision]`` and no local
    path of that name exists; None otherwise (``embedded``, a path, anything else)."""
    if text == EMBEDDED or Path(text).exists():
        return None
    m = _REPO_REF.match(text)
    return (m.group("repo"), m.group("rev")) if m else None


def source_name(text: str) -> str:
    """A name for SRC as written, for default output names: ``gemma4-tiny`` for the embedded
    model, the repo name for a repo id (``google/gemma-4-26B-A4B-it@main`` ->
    ``gemma-4-26B-A4B-it``), else the directory's own name. Never contains a slash."""
    if text == EMBEDDED:
        return EMBEDDED_OUT_NAME
    ref = parse_repo_ref(text)
    return ref[0].split("/", 1)[1] if ref else Path(text).resolve().name


def resolve_source(text: str, *, config_only: bool = False) -> Path:
    """The local directory (or file) SRC ``text`` names; see the module docstring for the order.

    Args:
        text: SRC as the user wrote it.
        config_only: for a repo id, fetch only ``config.json`` (``g4convert plan`` reads
            nothing else); a snapshot already in the cache is used whole.

    Returns:
        The embedded model's directory, the local path, or the repo's snapshot directory in the
        Hugging Face cache (``.../models--owner--name/snapshots/<commit>``). A path that does
        not exist is returned as it is, for the caller to report.

    Raises:
        OptionError: ``text`` is empty or blank (``""`` would otherwise be the working directory).
        G4Error: a repo id whose repo or revision the Hub does not have (or that is private or
            gated and no token with access was given: the message says how to log in), a repo
            without safetensors weights, or a repo that is not (fully) in the cache while
            ``HF_HUB_OFFLINE=1`` is set or the Hub cannot be reached. One line each.
    """
    if not text.strip():  # Path("") is the working directory: never read it as SRC
        raise OptionError(f"SRC is empty ({text!r}): give {SRC_FORMS}")
    if text == EMBEDDED:
        return EMBEDDED_DIR
    ref = parse_repo_ref(text)
    if ref is None:
        return Path(text)
    return _from_hub(text, *ref, config_only=config_only)


def _from_hub(text: str, repo_id: str, revision: str | None, *, config_only: bool) -> Path:
    import huggingface_hub
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )


    quiet_http_logs()
    top_level_only = ["*/*"]  # fnmatch's * crosses "/": allow-listed names must not match inside folders
    where = f"{repo_id}@{revision}" if revision else repo_id
    offline = "HF_HUB_OFFLINE=1 is set" if huggingface_hub.is_offline_mode() else None
    if offline is None:
        why = hub_unreachable()
        if why is not None:  # once, in one line; every request below then reads the cache only
            offline = f"the Hub ({constants.ENDPOINT}) cannot be reached"
            log.warning("the Hub (%s) cannot be reached (%s): using the Hugging Face cache (%s); "
                        "HF_HUB_OFFLINE=1 skips this check", constants.ENDPOINT, why, constants.HF_HUB_CACHE)
    cache_only = offline is not None
    try:
        # config.json alone first: a gated, unknown or uncached repo fails here, before any progress bar
        root = Path(hf_hub_download(repo_id, CONFIG_NAME, revision=revision,
                                    local_files_only=cache_only)).parent  # snapshots/<commit>
        if not config_only:
            root = Path(snapshot_download(repo_id, revision=root.name, allow_patterns=list(SOURCE_META_FILES),
                                          ignore_patterns=top_level_only, local_files_only=cache_only))
            try:
                config = json.loads((root / CONFIG_NAME).read_text())
            except (OSError, ValueError):
                config = None  # reported by Checkpoint, with its file name
            if isinstance(config, dict):
                refuse_quantized(root, config)  # before any weights are fetched
            weights = weight_files(root)  # the shards the index names, or model.safetensors
            listed = _cached_listing(repo_id, root.name)
            absent = [f for f in weights if listed is not None and f not in listed]
            if absent:
                raise G4Error(f"{where}: {absent[0]} is not in the repo (g4 reads safetensors weights only: "
                              "model.safetensors or the shards model.safetensors.index.json names; pickle files "
                              "are never downloaded)")
            # exactly the named shards (a subfolder shard too, as the index may name one), glob-escaped
            root = Path(snapshot_download(repo_id, revision=root.name, allow_patterns=[glob.escape(f) for f in weights],
                                          local_files_only=cache_only))
            missing = [f for f in weights if not (root / f).is_file()]
            if missing:
                raise G4Error(f"{where}: {missing[0]} is not in the cached snapshot and " + (
                    f"{offline}; {_online_hint(offline)}" if offline else
                    "could not be downloaded (is the Hub reachable?)"))
    except GatedRepoError as e:  # a subclass of RepositoryNotFoundError: first
        raise G4Error(f"{where} is a gated repo and this request has no access: accept its terms at "
                      f"{constants.ENDPOINT}/{repo_id}, then {_LOGIN} (a token of an account with access)") from e
    except RemoteEntryNotFoundError as e:
        raise G4Error(f"{where}: the repo has no config.json (not a Hugging Face checkpoint)") from e
    except RevisionNotFoundError as e:
        raise G4Error(f"{where}: revision {revision!r} not found in {repo_id} (a branch, tag or commit)") from e
    except RepositoryNotFoundError as e:
        raise G4Error(f"{text}: no such local path, and no repo {repo_id} on {constants.ENDPOINT} that this request "
                      f"may read (if it is private or gated, {_LOGIN})") from e
    except LocalEntryNotFoundError as e:  # IncompleteSnapshotError too
        raise G4Error(_not_cached(where, repo_id, revision, offline, e)) from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        hint = f"; {_LOGIN} (a token of an account with access)" if status in (401, 403) else ""
        raise G4Error(f"{where}: the Hub answered {status}: {_first_line(e)}{hint}") from e
    except HFValidationError as e:
        raise G4Error(f"{text}: no such local path, and not a Hub repo id ({_first_line(e)})") from e
    log.info("SRC %s: %s", where, root)
    return root


#: Seconds :func:`hub_unreachable` waits for the Hub's answer.
PROBE_TIMEOUT_S = 5.0


def hub_unreachable(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the Hub (``HF_ENDPOINT``, default https://huggingface.co) cannot be reached, or None
    when it answers at all (any HTTP status). One HEAD request through huggingface_hub's own
    HTTP client (its proxies and headers), without retries, at most ``timeout_s`` seconds: so a
    machine without network falls back to the cache at once, not after huggingface_hub's retries
    (five per request, about 50 s for a snapshot)."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s, follow_redirects=False)
    except httpx2.TransportError as e:  # connect, DNS, proxy, timeout
        return _first_line(e) if str(e).strip() else type(e).__name__
    return None


def _online_hint(offline: str) -> str:
    return "unset it to download" if offline.startswith("HF_HUB_OFFLINE") else "connect to download"


def _not_cached(where: str, repo_id: str, revision: str | None, offline: str | None, e: Exception) -> str:
    """The message for a repo id the Hugging Face cache cannot resolve: the repo is not cached at
    all, the revision is not one the cache knows (a branch or tag never fetched, or a commit id
    shorter than 40 hex digits, which only the Hub resolves: the full id is named when one cached
    commit starts with it), or the snapshot is incomplete."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    cache = constants.HF_HUB_CACHE
    reason = offline or f"the Hub ({constants.ENDPOINT}) cannot be reached ({_first_line(e)})"
    hint = f"; {_online_hint(offline)}" if offline else ""
    folder = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshots = sorted(p.name for p in (folder / "snapshots").glob("*") if p.is_dir())
    if not snapshots:
        return f"{where}: not in the Hugging Face cache ({cache}) and {reason}{hint}"
    refs_dir = folder / "refs"
    refs = sorted(p.relative_to(refs_dir).as_posix() for p in refs_dir.rglob("*") if p.is_file()) \
        if refs_dir.is_dir() else []
    rev = revision or "main"
    if rev not in refs and rev not in snapshots:
        matches = [c for c in snapshots if re.fullmatch(r"[0-9a-f]{4,39}", rev) and c.startswith(rev)]
        known = ", ".join([*refs, *(c[:12] for c in snapshots)])
        fix = (f"; pass the full commit id: {repo_id}@{matches[0]}" if len(matches) == 1 else
               f"; give a branch, a tag or a full 40-hex commit id the cache holds, or {_online_hint(offline)}"
               if offline else "")
        return (f"{where}: unknown revision {rev!r}: the Hugging Face cache ({cache}) holds {repo_id} at {known} "
                f"and {reason}{fix}")
    return f"{where}: not fully in the Hugging Face cache ({cache}) and {reason}{hint}"


def _cached_listing(repo_id: str, commit: str) -> set[str] | None:
    """The repo's file names at ``commit`` from the tree listing huggingface_hub caches while
    online (``snapshot_download``), or None when it has none."""
    import huggingface_hub
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {f.path for f in huggingface_hub.get_cached_repo_tree(repo_id, revision=commit)}
    except CachedRepoTreeNotFoundError:
        return None


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def quiet_http_logs() -> None:
    """One line per request from httpx2 only with -v (DEBUG); huggingface_hub's warnings
    once (it has its own handler, so not also through the root logger)."""
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("huggingface_hub").propagate = False
