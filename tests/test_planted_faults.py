"""The planted-fault harness (``python -m tests.planted_faults``) stays runnable: every fault's edit
still applies to the code once, and a scratch copy is what ``import g4`` finds under the lane
environment. The harness itself runs outside the default test run (its lanes take ~50 minutes)."""

from __future__ import annotations

import os

import pytest

from planted_faults import FAULTS, LANES, REPO, apply, check_imports_from, lane_env, make_copy, summary, failed_tests, LaneRun


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_edits_the_code_it_names_once(fault):
    assert set(fault.lanes) <= set(LANES), fault.lanes
    for e in fault.edits:
        text = (REPO / e.path).read_text()
        assert text.count(e.old) == 1, (fault.name, e.path, e.old)
        assert e.old != e.new


def test_fault_names_are_unique_and_cover_every_lane():
    names = [f.name for f in FAULTS]
    assert len(names) == len(set(names))
    assert {lane for f in FAULTS for lane in f.lanes} == set(LANES)


def test_a_scratch_copy_is_what_g4_imports_and_a_fault_lands_there(tmp_path):
    root = tmp_path / "copy"
    env = lane_env(make_copy(root))
    check_imports_from(root, env)
    fault = next(f for f in FAULTS if f.name == "int8-absmax-128")
    apply(fault, root)
    assert "INT8_QMAX = 128.0" in (root / "quantizers" / "int8.py").read_text()
    assert "INT8_QMAX = 127.0" in (REPO / "quantizers" / "int8.py").read_text()  # this checkout untouched
    with pytest.raises(ValueError, match="not once"):
        apply(fault, root)  # applied already: the text to replace is gone
    # without the shim, `import g4` is this checkout's editable install: the check refuses it
    plain = dict(env, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    with pytest.raises(RuntimeError, match="not what `import g4` finds"):
        check_imports_from(root, plain)


def test_summary_says_survived_caught_or_did_not_run():
    assert "SURVIVED" in summary(LaneRun("nxdi", 0, 1.0, passed=5))
    assert summary(LaneRun("nxdi", 1, 1.0, passed=5, failed=["a", "b"])) == "nxdi: caught by 2 of 7 (a, b)"
    assert "DID NOT RUN" in summary(LaneRun("vllm", 0, 1.0, skipped=["x: no vLLM environment"]))


def test_failed_tests_are_grouped_by_function_with_their_cases():
    assert failed_tests(["test_a[x]", "test_a[y]", "test_b", "test_c[z]"]) == "a[x,y], b, c[z]"
