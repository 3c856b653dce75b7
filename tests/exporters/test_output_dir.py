"""atomic_output_dir: the result is renamed into place only over what was checked; a user's
files are never deleted, whatever appears at OUT while a run works."""

import errno
import fcntl
import json
import logging
import os
import re
from types import SimpleNamespace

import pytest

from g4.core.errors import ExportError
from g4.exporters import output_dir
from g4.exporters.output_dir import atomic_output_dir


@pytest.fixture(params=["renameat2", "fallback"])
def renames(request, monkeypatch):
    """Each test runs with Linux renameat2 and with the fallback for systems without it."""
    if request.param == "fallback":
        monkeypatch.setattr(output_dir, "_renameat2", None)
    return request.param


def g4_result(path, tag):
    path.mkdir()
    (path / "hf_quant_config.json").write_text(json.dumps({"converter": {"name": "g4"}, "tag": tag}))
    return path


def kept_path(message):
    return re.search(r"the finished result is in (\S+)$", message).group(1)


def leftovers(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.mark.parametrize("user_file", [True, False])
def test_out_appearing_during_the_run_is_kept_and_the_result_kept_beside(tmp_path, renames, user_file):
    """Without --overwrite, a directory made at OUT meanwhile (even an empty one, which a plain
    rename would silently replace) stays as it is; the result is kept beside it, named."""
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="appeared while this run was converting") as e:
        with atomic_output_dir(out) as tmp:
            (tmp / "model.safetensors").write_text("new")
            out.mkdir()
            if user_file:
                (out / "mine.txt").write_text("user's")
    assert [p.name for p in out.iterdir()] == (["mine.txt"] if user_file else [])
    kept = kept_path(str(e.value))
    assert kept == str(tmp_path / f"out.new-{os.getpid()}")
    assert (tmp_path / kept / "model.safetensors").read_text() == "new"
    assert leftovers(out) == []


def test_two_runs_to_one_out_the_second_to_finish_is_refused(tmp_path, renames):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="appeared") as e:
        with atomic_output_dir(out) as first:
            (first / "model.safetensors").write_text("first")
            with atomic_output_dir(out) as second:
                (second / "model.safetensors").write_text("second")
    assert (out / "model.safetensors").read_text() == "second"
    assert (tmp_path / kept_path(str(e.value)) / "model.safetensors").read_text() == "first"
    assert leftovers(out) == []


@pytest.mark.parametrize("change", ["user dir", "another g4 result", "markers removed"])
def test_overwrite_replaces_only_the_g4_result_found_at_the_start(tmp_path, renames, change):
    out = g4_result(tmp_path / "out", "old")
    with pytest.raises(ExportError, match="was replaced or changed while this run was converting") as e:
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_text("new")
            if change == "markers removed":
                (out / "hf_quant_config.json").unlink()
                (out / "mine.txt").write_text("user's")
            else:
                os.rename(out, tmp_path / "moved")
                g4_result(out, "other") if change == "another g4 result" else out.mkdir()
                (out / "mine.txt").write_text("user's")
    assert (out / "mine.txt").read_text() == "user's"
    assert (tmp_path / kept_path(str(e.value)) / "model.safetensors").read_text() == "new"
    assert leftovers(out) == []


def test_overwrite_swaps_in_the_new_result(tmp_path, renames):
    out = g4_result(tmp_path / "out", "old")
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert leftovers(out) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_second_overwrite_run_is_refused_while_the_first_works(tmp_path):
    out = g4_result(tmp_path / "out", "old")
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("first")
        with pytest.raises(ExportError, match="another g4 run is replacing it"):
            with atomic_output_dir(out, overwrite=True):
                pass
    assert (out / "model.safetensors").read_text() == "first"


def test_leftovers_of_killed_runs_go_by_their_lock_not_their_pid(tmp_path, caplog):
    """A partial dir nobody holds is removed with a log line even when its pid now belongs to a
    live process (pid reuse); one a live run holds locked stays even when its pid looks dead."""
    out = tmp_path / "out"
    reused = tmp_path / f".out.partial-{os.getppid()}-0badcafe"  # an old run's pid, taken since by a live process
    reused.mkdir()
    (reused / "model.safetensors").write_text("half")
    live = tmp_path / ".out.partial-999999999-abcd1234"  # e.g. a run in another pid namespace
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with caplog.at_level(logging.WARNING, logger="g4.exporters.output_dir"):
            with atomic_output_dir(out) as tmp:
                (tmp / "model.safetensors").write_text("new")
    finally:
        os.close(fd)
    assert not reused.exists() and live.is_dir()
    assert f"removed {reused}: the unfinished output of a g4 run that was killed" in caplog.text
    assert str(live) not in caplog.text


def test_result_set_aside_by_a_killed_overwrite_run_is_restored(tmp_path, caplog):
    """Killed between moving OUT aside and renaming the new result in (only possible without
    renameat2, and only by SIGKILL): the next run puts the old result back, then refuses as usual."""
    out = tmp_path / "out"
    aside = g4_result(tmp_path / ".out.old-999999999-abcd1234", "old")
    with caplog.at_level(logging.WARNING, logger="g4.exporters.output_dir"):
        with pytest.raises(ExportError, match="already exists"):
            with atomic_output_dir(out):
                pass
    assert json.loads((out / "hf_quant_config.json").read_text())["tag"] == "old" and not aside.exists()
    assert f"restored {out} from {aside}" in caplog.text


def test_without_file_locks_the_pid_in_the_name_decides(tmp_path, monkeypatch, caplog):
    """On a file system without flock (some network mounts) a run still works, and a leftover
    is removed only when the pid in its name is not a live process."""
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(output_dir, "fcntl", SimpleNamespace(flock=no_locks, LOCK_EX=2, LOCK_NB=4))
    out = tmp_path / "out"
    dead, live = tmp_path / ".out.partial-999999999-abcd1234", tmp_path / f".out.partial-{os.getppid()}-abcd1234"
    dead.mkdir(), live.mkdir()
    with caplog.at_level(logging.WARNING, logger="g4.exporters.output_dir"):
        with atomic_output_dir(out) as tmp:
            (tmp / "model.safetensors").write_text("new")
    assert (out / "model.safetensors").read_text() == "new"
    assert not dead.exists() and live.is_dir() and f"removed {dead}" in caplog.text


def test_leftover_clean_up_touches_only_g4s_own_names(tmp_path, caplog):
    """A user's ``.OUT.partial-mine`` or ``.OUT.old-keep`` beside OUT is neither removed nor moved
    to OUT; an OUT name with glob characters (``m[1]``, ``r*``) cleans up its own leftovers and
    no other OUT's; a set-aside dir that is not only a g4 result is never moved or removed."""
    mine = tmp_path / ".r1.partial-mybackup"
    mine.mkdir()
    (mine / "data.txt").write_text("x")
    keep = g4_result(tmp_path / ".r1.old-keep", "user's")
    with_notes = g4_result(tmp_path / ".r1.old-999999999-abcd1234", "old")
    (with_notes / "NOTES.txt").write_text("mine")
    other = tmp_path / ".rX.partial-999999999-abcd1234"  # another OUT's leftover, which r* must not sweep
    other.mkdir()
    odd = tmp_path / ".m[1].partial-999999999-abcd1234"
    odd.mkdir()
    with caplog.at_level(logging.WARNING, logger="g4.exporters.output_dir"):
        for name in ("r1", "r*", "m[1]"):
            with atomic_output_dir(tmp_path / name) as tmp:
                (tmp / "model.safetensors").write_text("new")
    assert (mine / "data.txt").read_text() == "x" and keep.is_dir() and (with_notes / "NOTES.txt").is_file()
    assert other.is_dir() and not odd.exists() and f"removed {odd}" in caplog.text
    assert (tmp_path / "r1" / "model.safetensors").read_text() == "new"


def test_overwrite_never_deletes_files_a_user_added_to_a_g4_result(tmp_path, renames):
    """--overwrite replaces a g4 result only when it holds nothing but g4's own files; a user's
    notes or evaluation folder inside it stop the run up front (named), and also when they
    appear while it works (the new result is then kept beside)."""
    out = g4_result(tmp_path / "out", "old")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    for name in ("model-00001-of-00001.safetensors", "README.md", "verification.json", "tokenizer.json",
                 "neuron_compiled/model.pt"):
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("g4's")
    (out / "my_eval").mkdir()
    (out / "my_eval" / "res.json").write_text("mine")
    with pytest.raises(ExportError, match=r"holds my_eval/res.json, which g4 did not write"):
        with atomic_output_dir(out, overwrite=True):
            pytest.fail("must refuse before the run")
    (out / "my_eval" / "res.json").unlink()  # an empty folder is the user's too (g4 makes none)
    with pytest.raises(ExportError, match=r"holds my_eval/, which g4 did not write"):
        with atomic_output_dir(out, overwrite=True):
            pytest.fail("must refuse before the run")
    (out / "my_eval").rmdir()
    with pytest.raises(ExportError, match="is not the g4 result --overwrite was given") as e:
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_text("new")
            (out / "NOTES.txt").write_text("mine")
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "README.md").read_text() == "g4's"
    kept = kept_path(str(e.value))
    assert open(os.path.join(kept, "model.safetensors")).read() == "new"
    (out / "NOTES.txt").unlink()
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("newer")
    assert (out / "model.safetensors").read_text() == "newer" and not (out / "README.md").exists()
