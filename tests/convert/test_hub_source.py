"""SRC given as a Hub repo id (``owner/name[@revision]``) to every command that takes a source:
resolved through huggingface_hub's cache (offline too) or downloaded from a local
Hub-compatible server (tests/mock_hub.py) with only the files g4 reads; gated, unknown and
offline-not-cached repos give one ``error:`` line and exit 2.

The commands run in a subprocess, so huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE,
HF_HUB_OFFLINE and HF_TOKEN at import as it would for a user.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard
from mock_hub import MockHub
from safetensors.torch import load_file, save_file

from helpers import one_error_line, run_module

from g4.exporters.formats import CARD_FILE

REPO = "google/gemma-4-tiny-test"
TOKEN = "hf_g4TestSecretToken0123456789abcdef"
SOURCE_README = "---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# tiny\n"


@pytest.fixture(scope="module")
def repo_files(tiny_mm, tmp_path_factory):
    """tiny_mm as a Hub repo: two shards and their index, configs, tokenizer, chat template and
    README, plus files g4 must never fetch: pickles, another weight format, sub-folders."""
    tensors = load_file(tiny_mm / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    files, weight_map = {}, {}
    tmp = tmp_path_factory.mktemp("shards")
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp / shard, metadata={"format": "pt"})
        files[shard] = (tmp / shard).read_bytes()
        weight_map.update(dict.fromkeys(keys, shard))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    for p in tiny_mm.iterdir():
        if p.is_file() and p.name != "model.safetensors":
            files[p.name] = p.read_bytes()
    files[CARD_FILE] = SOURCE_README.encode()
    never = {"model.bin": b"\x80\x04pickle", "pytorch_model.bin": b"\x80\x04pickle",
             "consolidated.safetensors": files["model-00001-of-00002.safetensors"],
             "original/params.json": b"{}", "original/consolidated.00.pth": b"\x80\x04pickle",
             "original/tokenizer.json": files["tokenizer.json"]}
    return files, never


@pytest.fixture
def hub(repo_files):
    files, never = repo_files
    with MockHub() as h:
        h.add_token(TOKEN, "someone")
        h.create_repo(REPO, files={**files, **never})
        yield h


def g4(cmd, *args, hub=None, cache, cwd, offline=False, token=None):
    """Run ``g4convert``/``g4serve`` (module ``cmd``) with a clean huggingface_hub environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url if hub else "http://127.0.0.1:9", HF_HUB_DISABLE_XET="1",
               HF_HOME=str(cache.parent / "hf_home"), HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_TELEMETRY="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    return run_module(cmd, *args, env=env, cwd=cwd, clean_env=True)


def front_matter(text: str) -> dict:
    return ModelCard(text).data.to_dict()




def test_download_fetches_only_what_g4_reads_and_converts(hub, repo_files, tmp_path):
    files, never = repo_files
    cache = tmp_path / "cache"
    shard = "model-00002-of-00002.safetensors"
    hub.fail_downloads.add(shard)  # the first download breaks off at this shard
    r = g4("g4.convert.cli", "-q", "nvfp4", REPO, "--weight-only", hub=hub, cache=cache, cwd=tmp_path)
    one_error_line(r, "the Hub answered 500")
    first = len(hub.requests)
    r = g4("g4.convert.cli", "-q", "nvfp4", REPO, "--weight-only", hub=hub, cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    fetched = {path.rsplit("/", 1)[1] for method, path in hub.requests[first:] if method == "GET" and "/resolve/" in path}
    assert fetched == {shard}  # the rerun fetched only what the first run had not
    out = tmp_path / "gemma-4-tiny-test-nvfp4"  # the default OUT: the repo's name, never a path with a slash
    assert (out / "hf_quant_config.json").is_file() and (out / "chat_template.jinja").is_file()
    expected = set(files) - {"model.safetensors"}
    assert set(hub.downloads()) == expected  # asked for nothing else (HEAD or GET)
    snapshot = next((cache / "models--google--gemma-4-tiny-test" / "snapshots").iterdir())
    assert {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()} == expected
    assert all((snapshot / f).read_bytes() == files[f] for f in expected)
    for name in never:
        assert not any(name in path for _, path in hub.requests), name
    card = (out / CARD_FILE).read_text()
    meta = front_matter(card)
    assert meta["base_model"] == REPO and meta["license"] == "apache-2.0"
    # the exact commit converted, so that the command reproduces this result after main moves on
    assert f"g4convert nvfp4 {REPO}@{snapshot.name} gemma-4-tiny-test-nvfp4 --preset default --algorithm mse --weight-only" in card
    assert json.loads((out / "g4_conversion.json").read_text())["source"]["revision"] == snapshot.name

    # Resolved from the cache from now on: a second command with HF_HUB_OFFLINE=1 needs no Hub.
    before = len(hub.requests)
    r = g4("g4.convert.cli", "-q", "int8-neuron", REPO, "--tp", "2", cache=cache, cwd=tmp_path, offline=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "gemma-4-tiny-test-int8-neuron-tp2" / "manifest.json").is_file()
    assert len(hub.requests) == before


def _prefilled_cache(tiny_mm, tmp_path):
    """A Hub cache laid out as huggingface_hub writes it (refs/main -> snapshots/<commit>) holding
    ``tiny_mm`` as REPO; returns (cache, commit)."""
    cache = tmp_path / "cache"
    commit = "c0ffee" * 6 + "c0ff"
    snapshot = cache / "models--google--gemma-4-tiny-test" / "snapshots" / commit
    shutil.copytree(tiny_mm, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    return cache, commit


def test_prefilled_cache_resolves_offline_and_converts(tiny_mm, tmp_path):
    """A cache laid out as huggingface_hub writes it (refs/main -> snapshots/<commit>), no Hub at all."""
    cache, commit = _prefilled_cache(tiny_mm, tmp_path)
    r = g4("g4.convert.cli", "-q", "nvfp4", REPO, "--weight-only", cache=cache, cwd=tmp_path, offline=True)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "gemma-4-tiny-test-nvfp4"
    assert front_matter((out / CARD_FILE).read_text())["base_model"] == REPO
    assert json.loads((out / "g4_conversion.json").read_text())["source"]["name"] == "gemma-4-tiny-test"
    r = g4("g4.convert.cli", "verify", str(out), "--against", REPO, "--max-new-tokens", "2", cache=cache, cwd=tmp_path,
           offline=True)
    assert r.returncode in (0, 1) and "token agreement" in r.stdout, r.stdout + r.stderr  # random weights may FAIL

    r = g4("g4.convert.cli", "plan", f"{REPO}@{commit}", "--json", cache=cache, cwd=tmp_path, offline=True)
    assert r.returncode == 0 and json.loads(r.stdout)["inputs"]["model"] == "gemma-4-tiny-test", r.stderr
    r = g4("g4.convert.cli", "nvfp4", "google/not-cached", cache=cache, cwd=tmp_path, offline=True)
    one_error_line(r, "google/not-cached", "HF_HUB_OFFLINE=1")
    # (an OUT of its own: the default one exists by now, and an existing OUT is refused before SRC is resolved)
    r = g4("g4.convert.cli", "nvfp4", f"{REPO}@v2", str(tmp_path / "v2-nvfp4"), cache=cache, cwd=tmp_path, offline=True)
    one_error_line(r, f"{REPO}@v2: unknown revision 'v2'", f"holds {REPO} at main, {commit[:12]}", "HF_HUB_OFFLINE=1")
    # a short commit id: only the Hub resolves those; the cache's one commit that starts with it is named
    r = g4("g4.convert.cli", "plan", f"{REPO}@{commit[:7]}", cache=cache, cwd=tmp_path, offline=True)
    one_error_line(r, f"unknown revision '{commit[:7]}'", f"pass the full commit id: {REPO}@{commit}")
    assert "not (fully) in the" not in r.stderr


def test_an_unreachable_hub_is_said_once_and_the_cache_is_used(tiny_mm, tmp_path):
    """Fresh-user finding: with no network and no HF_HUB_OFFLINE a cached repo id took ~50 s of
    huggingface_hub retries, 12 "Retrying" lines even with -q. HF_ENDPOINT here is a closed port."""
    cache, commit = _prefilled_cache(tiny_mm, tmp_path)
    for quiet in (["-q"], []):
        r = g4("g4.convert.cli", *quiet, "int8-neuron", REPO, "--tp", "1", "--overwrite", cache=cache, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        said = [line for line in r.stderr.splitlines() if "cannot be reached" in line]
        assert len(said) == 1 and "using the Hugging Face cache" in said[0] and "http://127.0.0.1:9" in said[0], r.stderr
        assert "Retrying" not in r.stderr and "thrown while requesting" not in r.stderr
        if quiet:
            assert r.stderr.strip() == said[0]
    r = g4("g4.convert.cli", "plan", f"{REPO}@v9", cache=cache, cwd=tmp_path)
    said, error = r.stderr.strip().splitlines()
    assert said.startswith("the Hub (http://127.0.0.1:9) cannot be reached") and r.returncode == 2
    assert error.startswith(f"error: {REPO}@v9: unknown revision 'v9'") and "cannot be reached" in error


def test_revision(hub, tiny_mm, tmp_path):
    config = json.loads((tiny_mm / "config.json").read_text())
    v1 = hub.repos[REPO].branches["main"]
    hub.repos[REPO].branches["v1"] = v1
    bigger = dict(config, text_config=dict(config["text_config"], num_experts=2 * config["text_config"]["num_experts"]))
    head = hub.add_commit(REPO, {"config.json": json.dumps(bigger).encode()})
    cache = tmp_path / "cache"

    def plan(src):
        r = g4("g4.convert.cli", "plan", src, "--json", hub=hub, cache=cache, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    local = plan(str(tiny_mm / "config.json"))
    for rev in ("v1", v1):
        assert plan(f"{REPO}@{rev}")["experts"] == local["experts"]
    assert plan(REPO)["experts"] == 2 * local["experts"]  # main is the newer commit
    assert set(hub.downloads()) == {"config.json"}  # plan reads the config alone
    snapshots = cache / "models--google--gemma-4-tiny-test" / "snapshots"
    assert sorted(p.name for p in snapshots.iterdir()) == sorted([v1, head])
    assert (cache / "models--google--gemma-4-tiny-test" / "refs" / "v1").read_text() == v1

    r = g4("g4.convert.cli", "plan", f"{REPO}@nope", hub=hub, cache=cache, cwd=tmp_path)
    one_error_line(r, "revision 'nope' not found")


COMMANDS = [("g4.convert.cli", "nvfp4", "{src}"), ("g4.convert.cli", "int8-neuron", "{src}"),
            ("g4.convert.cli", "plan", "{src}"), ("g4.convert.cli", "verify", "{out}", "--against", "{src}"),
            ("g4.serve.cli", "check", "{out}", "--against", "{src}")]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[1:2]))
def test_gated_repo_one_error_line_saying_how_to_log_in(command, hub, repo_files, tmp_path):
    hub.create_repo("google/gated", gated=True, files=repo_files[0])
    cmd, *args = [a.format(src="google/gated", out=tmp_path) for a in command]
    r = g4(cmd, *args, hub=hub, cache=tmp_path / "cache", cwd=tmp_path)
    one_error_line(r, "google/gated is a gated repo", "hf auth login", "HF_TOKEN")
    if command[1] == "nvfp4":  # a token of an account without access: 403, the same advice
        r = g4(cmd, *args, hub=hub, cache=tmp_path / "cache", cwd=tmp_path, token=TOKEN)
        one_error_line(r, "google/gated is a gated repo", "hf auth login")
        assert TOKEN not in r.stderr
    assert not list(tmp_path.glob("gated-*"))


def test_unknown_repo_one_error_line(hub, tmp_path):
    r = g4("g4.convert.cli", "nvfp4", "google/no-such-model", hub=hub, cache=tmp_path / "cache", cwd=tmp_path)
    one_error_line(r, "google/no-such-model: no such local path, and no repo google/no-such-model")
    r = g4("g4.serve.cli", "check", str(tmp_path), "--against", "nobody/x@main", hub=hub, cache=tmp_path / "cache",
           cwd=tmp_path)
    one_error_line(r, "nobody/x@main: no such local path")


def test_repo_without_safetensors_one_error_line(hub, repo_files, tmp_path):
    files, never = repo_files
    hub.create_repo("google/pickled", files={"config.json": files["config.json"], "pytorch_model.bin": b"\x80\x04"})
    r = g4("g4.convert.cli", "-q", "nvfp4", "google/pickled", hub=hub, cache=tmp_path / "cache", cwd=tmp_path)
    one_error_line(r, "google/pickled: model.safetensors is not in the repo", "pickle files are never downloaded")
    assert "pytorch_model.bin" not in hub.downloads()


def test_existing_local_path_wins_over_a_repo_id(hub, tiny_mm, tmp_path):
    shutil.copytree(tiny_mm, tmp_path / "google" / "gemma-4-tiny-test")
    r = g4("g4.convert.cli", "plan", REPO, "--json", hub=hub, cache=tmp_path / "cache", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert hub.requests == []


def test_log_lines_do_not_print_onto_the_progress_bar(tiny_mm, tmp_path):
    r = subprocess.run([sys.executable, "-m", "g4.convert.cli", "nvfp4", str(tiny_mm), str(tmp_path / "out"),
                        "--weight-only"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    logged = [line for line in r.stderr.split("\n") if "dense groups" in line]
    assert len(logged) == 2, r.stderr  # one per layer, written while the bar is shown
    for line in logged:  # what remains on the terminal line after the bar's carriage returns
        assert line.split("\r")[-1].startswith("layer "), repr(line)


def test_a_shard_the_index_names_in_a_subfolder_is_downloaded(repo_files, tmp_path):
    """The index may name a shard in a subfolder (as local SRC allows); only that file of the
    subfolder is fetched, and the conversion reads it."""
    files, never = repo_files
    moved = "model-00002-of-00002.safetensors"
    index = json.loads(files["model.safetensors.index.json"])
    index["weight_map"] = {k: f"sub/{v}" if v == moved else v for k, v in index["weight_map"].items()}
    repo = {k: v for k, v in files.items() if k != moved}
    repo.update({"model.safetensors.index.json": json.dumps(index).encode(), f"sub/{moved}": files[moved],
                 "sub/other.safetensors": files[moved]})
    cache = tmp_path / "cache"
    with MockHub() as hub:
        hub.create_repo(REPO, files=repo)
        r = g4("g4.convert.cli", "-q", "nvfp4", REPO, "--weight-only", hub=hub, cache=cache, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"sub/{moved}" in hub.downloads() and "sub/other.safetensors" not in hub.downloads()
    assert (tmp_path / "gemma-4-tiny-test-nvfp4" / "hf_quant_config.json").is_file()


def test_quantized_or_pickle_naming_repos_are_refused_without_fetching_weights(repo_files, tmp_path):
    """A repo with an ``hf_quant_config.json`` is refused as already quantized, as the same files
    in a local directory are (so that file is among the few fetched); an index that names a
    ``.bin`` is refused by name, and the file is never requested."""
    files, never = repo_files
    quantized = {**files, "hf_quant_config.json": json.dumps({"quantization": {"quant_algo": "NVFP4"}}).encode()}
    index = json.loads(files["model.safetensors.index.json"])
    index["weight_map"] = {k: "pytorch_model.bin" if v.endswith("2.safetensors") else v
                           for k, v in index["weight_map"].items()}
    pickled = {**files, "model.safetensors.index.json": json.dumps(index).encode(), "pytorch_model.bin": b"\x80\x04"}
    cache = tmp_path / "cache"
    with MockHub() as hub:
        hub.create_repo("me/hfq", files=quantized)
        hub.create_repo("me/pickle", files=pickled)
        for cmd in (["-q", "nvfp4", "me/hfq", "--weight-only"], ["-q", "plan", "me/hfq"]):
            one_error_line(g4("g4.convert.cli", *cmd, hub=hub, cache=cache, cwd=tmp_path), "hf_quant_config.json",
                           "NVFP4")
        one_error_line(g4("g4.convert.cli", "-q", "nvfp4", "me/pickle", hub=hub, cache=cache, cwd=tmp_path),
                       "pytorch_model.bin", "not a .safetensors file")
        assert not [f for f in hub.downloads() if f.endswith(".safetensors") or f.endswith(".bin")]
