"""``g4convert push`` against a local Hub-compatible server (tests/mock_hub.py): one atomic
commit, resume after an interrupted upload, remote == local check, errors, token hygiene.

The pushes run the real CLI in a subprocess, so huggingface_hub reads HF_ENDPOINT,
HF_TOKEN and HF_HUB_DISABLE_XET (the mock speaks the LFS protocol, not Xet) at import as
it would for a user, and everything the process prints or logs is captured.
"""

import hashlib
import json
import os
import shutil

import pytest
from mock_hub import MockHub
from tampered import NVFP4_TAMPERS, assert_one_error_line, tampered_copy
from serve_fixtures import embedded_result

from helpers import run_module

from g4.convert.nvfp4 import convert_nvfp4
from g4.convert.push import HubError, push_result
from g4.exporters.formats import CARD_FILE

TOKEN = "hf_g4TestSecretToken0123456789abcdef"
READ_TOKEN = "hf_g4TestReadOnlyToken0123456789ab"
REPO = "someone/tiny-nvfp4"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_mm):
    """A real NVFP4 result with an index, 3 shards, configs and the chat template (case P15)."""
    out = tmp_path_factory.mktemp("push") / "tiny-nvfp4"
    convert_nvfp4(tiny_mm, out, weight_only=True, max_shard_size="100kB", progress=False)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert {"model.safetensors.index.json", "config.json", "chat_template.jinja", CARD_FILE} <= {
        p.name for p in out.iterdir()}
    return out


@pytest.fixture
def out(sharded, tmp_path):
    return shutil.copytree(sharded, tmp_path / "tiny-nvfp4")


@pytest.fixture
def hub():
    with MockHub() as h:
        h.add_token(TOKEN, "someone", orgs=("team",))
        h.add_token(READ_TOKEN, "someone", role="read")
        yield h


def g4push(hub, *args, token=TOKEN, home=None, xet=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home or hub.home),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if not xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    if token:
        env["HF_TOKEN"] = token
    r = run_module("g4.convert.cli", *args, env=env, clean_env=True, timeout=120)
    assert TOKEN not in r.stdout + r.stderr and READ_TOKEN not in r.stdout + r.stderr
    return r


@pytest.fixture(autouse=True)
def _home(hub, tmp_path):
    hub.home = tmp_path / "hf_home"  # no stored login from the machine running the tests
    hub.home.mkdir()


def local_files(out):
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def assert_remote_equals_local(hub, out, repo=REPO, rev="main"):
    remote = hub.files(repo, rev)
    local = local_files(out)
    assert set(remote) - {".gitattributes"} == set(local)
    for path, data in local.items():
        assert remote[path].size == len(data) and hub.content(repo, path, rev) == data, path
        if path.endswith(".safetensors"):
            assert remote[path].lfs_oid == hashlib.sha256(data).hexdigest()


def test_dry_run_lists_files_renders_card_sends_nothing(hub, out):
    before = local_files(out)
    r = g4push(hub, "push", str(out), REPO, "--dry-run", token=None)
    assert r.returncode == 0, r.stderr
    assert hub.requests == [] and local_files(out) == before  # nothing sent, nothing written
    for name, data in before.items():
        if name != CARD_FILE:
            assert f"{len(data):,} B  {name}" in r.stdout
    assert "# tiny-nvfp4" in r.stdout and "vllm serve someone/tiny-nvfp4 " in r.stdout
    assert "--- README.md (model card) ---" in r.stdout and "note: the card names no base_model" in r.stderr


def test_push_one_commit_then_remote_equals_local(hub, out):
    r = g4push(hub, "-v", "push", str(out), REPO, "--private")
    assert r.returncode == 0, r.stderr
    repo = hub.repos[REPO]
    assert repo.private
    assert len(repo.commits) == 2  # the Hub's initial commit, then everything in one commit
    commit = repo.resolve("main")
    assert {"model.safetensors.index.json", "model-00003-of-00003.safetensors", "config.json"} <= set(commit.files)
    assert_remote_equals_local(hub, out)
    assert hub.lfs_uploads == 3  # the three shards went through LFS, the JSON/text files inline
    assert "vllm serve someone/tiny-nvfp4 " in (out / CARD_FILE).read_text()  # card re-rendered for the repo
    assert "verified someone/tiny-nvfp4@" in r.stdout and "names, sizes and hashes of all" in r.stdout
    # A second push of the same result sends nothing and makes no commit.
    r = g4push(hub, "push", str(out), REPO)
    assert r.returncode == 0, r.stderr
    assert len(repo.commits) == 2 and hub.lfs_uploads == 3 and "already held exactly these files" in r.stdout


def test_a_card_its_owner_edited_is_pushed_as_it_is_never_rewritten(hub, out):
    card = out / CARD_FILE
    mine = card.read_text() + "\n## Our evaluation\n\nNotes nobody else has.\n"
    card.write_text(mine)
    r = g4push(hub, "push", str(out), REPO, "--dry-run")
    assert r.returncode == 0 and "README.md was edited after g4 wrote it" in r.stderr, r.stderr
    assert "Notes nobody else has." in r.stdout and card.read_text() == mine
    r = g4push(hub, "push", str(out), REPO)
    assert r.returncode == 0, r.stderr
    assert "README.md was edited after g4 wrote it: it is uploaded as it is" in r.stderr
    assert card.read_text() == mine and hub.content(REPO, CARD_FILE).decode() == mine
    assert_remote_equals_local(hub, out)


def test_interrupted_upload_leaves_main_untouched_and_rerun_resumes(hub, out):
    hub.fail_lfs_after = 2  # the third shard upload fails
    r = g4push(hub, "push", str(out), REPO)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "nothing committed" in r.stderr
    repo = hub.repos[REPO]
    assert hub.lfs_uploads == 2 and hub.lfs_failures >= 1
    assert len(repo.commits) == 1 and set(hub.files(REPO)) == {".gitattributes"}  # main never saw a shard
    for c in repo.commits.values():  # no commit anywhere references a blob that is not stored
        assert all(e.lfs_oid in repo.lfs for e in c.files.values() if e.lfs_oid)
    hub.fail_lfs_after = None
    r = g4push(hub, "push", str(out), REPO)
    assert r.returncode == 0, r.stderr
    assert hub.lfs_uploads == 3  # only the missing shard was sent again
    assert len(repo.commits) == 2
    assert_remote_equals_local(hub, out)


def test_a_hub_without_xet_storage_is_one_error_line_naming_the_switch_without_retries(hub, out):
    """huggingface/huggingface_hub #4786: a Hub-compatible server without Xet answers the Xet
    token request with 404, which huggingface_hub raises as a ConnectionError; that is not a
    network failure to retry."""
    r = g4push(hub, "push", str(out), REPO, xet=True)
    assert r.returncode == 2
    assert r.stderr.count("error: ") == 1 and "retry" not in r.stderr, r.stderr
    assert "has no Xet storage" in r.stderr and "HF_HUB_DISABLE_XET=1" in r.stderr
    assert set(hub.files(REPO)) == {".gitattributes"}  # nothing committed
    assert g4push(hub, "push", str(out), REPO).returncode == 0  # with the switch set, it goes through


def test_remote_mismatch_is_reported_nonzero(hub, out):
    # Push once, then corrupt the Hub's copy of a shard behind the client's back: a push
    # that finds "nothing to upload" must still compare and fail on the stored content.
    assert g4push(hub, "push", str(out), REPO).returncode == 0
    repo = hub.repos[REPO]
    entry = repo.resolve("main").files["model-00002-of-00003.safetensors"]
    entry.size += 1
    r = g4push(hub, "push", str(out), REPO, "--allow-existing")
    assert r.returncode == 2 and "differs from" in r.stderr
    assert "model-00002-of-00003.safetensors: size" in r.stderr


def test_branch_revision_and_commit_message(hub, out):
    hub.create_repo(REPO)
    r = g4push(hub, "push", str(out), REPO, "--revision", "nvfp4-w4a16", "--commit-message", "tiny NVFP4")
    assert r.returncode == 0, r.stderr
    assert set(hub.files(REPO, "main")) == {".gitattributes"}
    assert_remote_equals_local(hub, out, rev="nvfp4-w4a16")
    assert hub.repos[REPO].resolve("nvfp4-w4a16").title == "tiny NVFP4"


def test_existing_repo_with_other_content(hub, out):
    hub.create_repo(REPO, files={"notes.txt": b"someone else's repo\n", "config.json": b"{}"})
    heads = dict(hub.repos[REPO].branches)
    r = g4push(hub, "push", str(out), REPO)
    assert r.returncode == 2 and "already holds other content" in r.stderr and "--allow-existing" in r.stderr
    assert hub.repos[REPO].branches == heads and hub.lfs_uploads == 0  # refused before any upload
    r = g4push(hub, "push", str(out), REPO, "--allow-existing")
    assert r.returncode == 0, r.stderr
    assert "notes.txt" not in hub.files(REPO)  # removed in the same commit
    assert_remote_equals_local(hub, out)


def test_update_of_the_same_conversion_is_allowed(hub, out):
    from g4.serve.check import weight_fingerprints

    assert g4push(hub, "push", str(out), REPO).returncode == 0
    (out / "verification.json").write_text(json.dumps({
        "g4_verification": 1, "format": "nvfp4", "backend": "vllm", "source": "x", "min_agreement": 0.9,
        "passed": True, "overall": {"prompts": 1, "token_agreement": 1.0, "exact_match_prompts": 1,
                                    "facts_correct": 0, "facts_total": 0},
        "prompts": [], "facts": [], "chat_checks": [], "files": weight_fingerprints(out)}))
    r = g4push(hub, "push", str(out), REPO)  # card and verification change; the weights do not
    assert r.returncode == 0, r.stderr
    assert hub.lfs_uploads == 3 and "| result | PASS" in hub.content(REPO, CARD_FILE).decode()
    assert_remote_equals_local(hub, out)


@pytest.mark.parametrize("case", ["no token", "bad token", "read-only token", "other namespace"])
def test_auth_errors_are_one_line(hub, out, case):
    before = local_files(out)
    token = {"no token": None, "bad token": "hf_g4TestSecretToken0123456789abcdeX", "read-only token": READ_TOKEN,
             "other namespace": TOKEN}[case]
    repo = "stranger/tiny" if case == "other namespace" else REPO
    r = g4push(hub, "push", str(out), repo, token=token)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: "), r.stderr
    assert token is None or token not in r.stderr
    expected = {"no token": "no Hugging Face token: set HF_TOKEN", "bad token": "rejected the token (401)",
                "read-only token": "read-only", "other namespace": "no write access to stranger/tiny (403)"}[case]
    assert expected in r.stderr
    assert not hub.repos and hub.lfs_uploads == 0
    if case != "other namespace":
        assert local_files(out) == before  # OUT untouched when the token is unusable


def test_incomplete_or_oversized_result_is_refused_before_sending(hub, out):
    big = max((p for p in out.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    r = g4push(hub, "push", str(out), REPO, "--max-file-size", "100kB")
    assert r.returncode == 2 and f"{big}:" in r.stderr and "per-file limit" in r.stderr
    shard = out / "model-00002-of-00003.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-1000])  # a truncated shard is never published
    r = g4push(hub, "push", str(out), REPO)
    assert r.returncode == 2 and shard.name in r.stderr and "nothing was sent" in r.stderr, r.stderr
    shard.write_bytes(whole)
    (out / "model-00002-of-00003.safetensors").unlink()
    r = g4push(hub, "push", str(out), REPO)
    assert r.returncode == 2 and "incomplete result, missing model-00002-of-00003.safetensors" in r.stderr
    assert hub.requests == []


def test_network_failure_after_bounded_retries(out):
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HubError, match=r"network failure after 3 attempts \(ConnectError") as e:
        push_result(out, REPO, endpoint=f"http://127.0.0.1:{port}", token=TOKEN, attempts=3, retry_wait_s=0.01)
    assert TOKEN not in str(e.value)


def test_convert_with_push_to_hub(hub, tiny_mm, tmp_path):
    out = tmp_path / "pushed"
    r = g4push(hub, "-q", "nvfp4", str(tiny_mm), str(out), "--weight-only", "--push-to-hub", "team/tiny",
               token=None)
    assert r.returncode == 2 and "no Hugging Face token" in r.stderr and not out.exists()  # checked first
    r = g4push(hub, "-q", "nvfp4", str(tiny_mm), str(out), "--weight-only", "--push-to-hub", "team/tiny",
               "--base-model", "someone/tiny-source")
    assert r.returncode == 0, r.stderr
    assert_remote_equals_local(hub, out, repo="team/tiny")
    card = hub.content("team/tiny", CARD_FILE).decode()
    assert "base_model: someone/tiny-source" in card and "base_model_relation: quantized" in card


def test_push_int8_neuron_result_with_nested_rank_files(hub, tiny_mm, tmp_path):
    from g4.convert.int8_neuron import convert_int8_neuron

    out = tmp_path / "tiny-int8"
    convert_int8_neuron(tiny_mm, out, tp=2, progress=False)
    r = g4push(hub, "push", str(out), "someone/tiny-int8")
    assert r.returncode == 0, r.stderr
    assert {"weights/tp0_sharded_checkpoint.safetensors", "weights/tp1_sharded_checkpoint.safetensors",
            "embed_tokens.safetensors", "manifest.json"} <= set(hub.files("someone/tiny-int8"))
    assert_remote_equals_local(hub, out, repo="someone/tiny-int8")
    assert "g4serve tiny-int8 --backend neuron" in hub.content("someone/tiny-int8", CARD_FILE).decode()
    (out / "weights" / "tp1_sharded_checkpoint.safetensors").unlink()
    r = g4push(hub, "push", str(out), "someone/tiny-int8")
    assert r.returncode == 2 and "missing weights/tp1_sharded_checkpoint.safetensors" in r.stderr


@pytest.mark.parametrize("kind", sorted(NVFP4_TAMPERS))
def test_push_refuses_a_result_that_differs_from_its_table(hub, kind, tmp_path):
    """Checked against the output table before anything is written or sent: one line naming the
    file, the tensor and what differs, exit 2, no repo created, nothing uploaded, OUT untouched
    (not a push that reports 'verified')."""
    mutate, expected = NVFP4_TAMPERS[kind]
    bad = tampered_copy(embedded_result("nvfp4"), tmp_path / "bad", mutate)
    before = local_files(bad)
    r = g4push(hub, "push", str(bad), REPO)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert_one_error_line(r.stderr, bad / "model.safetensors", expected)
    assert not hub.repos and hub.lfs_uploads == 0
    assert local_files(bad) == before


@pytest.mark.parametrize("limit", ["1MB", "1kB", "1B"])
def test_a_file_over_the_users_limit_names_that_limit_and_shows_the_sizes(tmp_path, limit):
    """Fresh-user finding: `--max-file-size 1MB` said "0.00 GB is over the per-file limit of
    0.001 GB (HUB_MAX_FILE_BYTES: the Hub's limit)", and with 1kB it blamed README.md."""
    from click.testing import CliRunner

    from g4.convert.cli import main
    from g4.core.sizes import format_bytes, parse_size

    out = shutil.copytree(embedded_result("nvfp4"), tmp_path / "r")
    largest = max((p for p in out.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    assert largest.name == "model.safetensors" and largest.stat().st_size > 10**6
    r = CliRunner().invoke(main, ["push", str(out), REPO, "--dry-run", "--max-file-size", limit])
    assert r.exit_code == 2
    line = r.stderr.strip().splitlines()[-1]
    size = format_bytes(largest.stat().st_size)
    assert line.startswith(f"error: {largest}: {size} is over the per-file limit of "
                           f"{format_bytes(parse_size(limit))} that --max-file-size sets"), line
    assert f"raise --max-file-size to at least {size}" in line
    assert "Hub" not in line and "GB" not in line
    # a smaller --max-shard-size helps only when every file over the limit is a shard and a shard can meet it
    assert ("--max-shard-size" in line) == (limit == "1MB"), line


def test_a_file_over_the_hubs_limit_says_what_helps(tmp_path):
    from g4.convert.push import HUB_MAX_FILE_BYTES, LocalFile, check_file_sizes

    def files(*named):
        return [LocalFile(rel, tmp_path / rel, size) for rel, size in named]

    big = HUB_MAX_FILE_BYTES + 1
    with pytest.raises(HubError, match=r"model-00001-of-00002.safetensors: 200.000 GB \(200,000,000,001 bytes\) is over "
                                       r"the Hub's per-file limit of 200.000 GB \(200,000,000,000 bytes\); convert "
                                       r"again with a smaller --max-shard-size$"):
        check_file_sizes(tmp_path, files(("README.md", 10), ("model-00001-of-00002.safetensors", big)), None, "nvfp4")
    with pytest.raises(HubError, match=r"tp0_sharded_checkpoint.safetensors: .* the Hub's per-file limit .*: convert "
                                       r"again with a larger --tp$"):
        check_file_sizes(tmp_path, files(("weights/tp0_sharded_checkpoint.safetensors", 300 * 10**9)), None,
                         "int8-neuron")
    check_file_sizes(tmp_path, files(("model.safetensors", HUB_MAX_FILE_BYTES)), None, "nvfp4")  # at the limit: fine
