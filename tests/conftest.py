import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings("ignore", message=".*not tested with current version of modelopt.*")

import tiny  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _own_caches(tmp_path_factory):
    """Every test (and the processes it starts) uses empty caches of its own session, not the
    user's ~/.cache/g4: a kernel package there would stand in for the compiled kernels the tests
    check (g4.quantizers.compiled), and eval's and verify's cached SRC sides
    (g4.convert.stream.SourceSideCache) are made by this session's code only."""
    import os

    names = {"G4_KERNEL_CACHE": "kernel_cache", "G4_SOURCE_CACHE": "source_cache"}
    before = {env: os.environ.get(env) for env in names}
    for env, folder in names.items():
        os.environ[env] = str(tmp_path_factory.mktemp(folder))
    yield
    for env, value in before.items():
        if value is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = value


@pytest.fixture(scope="session")
def tiny_mm(tmp_path_factory) -> Path:
    """Random tiny multimodal Gemma 4 MoE (read-only: copy before modifying)."""
    return tiny.build(tmp_path_factory.mktemp("tiny_mm") / "src")


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    """Random tiny text-only (model.layers.*) Gemma 4 MoE with 8 experts."""
    return tiny.build(tmp_path_factory.mktemp("tiny_text") / "src", multimodal=False, num_experts=8)


@pytest.fixture(scope="session")
def tiny_mm_nvfp4(tmp_path_factory, tiny_mm) -> Path:
    from g4.convert.nvfp4 import convert_nvfp4

    out = tmp_path_factory.mktemp("tiny_mm_nvfp4") / "out"
    convert_nvfp4(tiny_mm, out, algorithm="max", calib_samples=4, calib_seq_len=32, calib_batch_size=4,
                  calib_dtype="bfloat16", progress=False)
    return out
