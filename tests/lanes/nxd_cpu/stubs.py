"""Make neuronx-distributed (NxD) v2.28.0 importable on a CPU-only machine, in a *subprocess only*.

NxD's real layers and sharder are plain torch on CPU (NxD's own CPU mode: ``NXD_CPU_MODE=1``,
``torch.distributed`` with gloo; aws-neuron/neuronx-distributed
``src/neuronx_distributed/utils/__init__.py`` ``cpu_mode`` and ``test/unit_test/utils/test_helper.py``),
but importing them reaches Neuron-only packages that exist nowhere but on Neuron hosts:

- ``torch_neuronx``, ``neuronxcc``, ``libneuronxla`` (and ``torch_xla``, stubbed too so that the
  lane runs in g4's own CPU torch) get an auto-attribute stub: every attribute is a ``MagicMock``
  and every submodule is another stub;
- ``torch_neuronx.utils.get_platform_target`` must return a real value (``parallel_state`` does
  ``hardware(get_platform_target())``, ``parallel_layers/parallel_state.py``);
- the package ``__init__`` of ``neuronx_distributed`` and of ``neuronx_distributed.trace`` must not
  run: it imports ``trace/spmd.py``, which evaluates ``torch.classes.neuron.SPMDModel`` (a
  TorchScript class only torch-neuronx's C++ library registers). They are registered as bare
  packages whose ``__path__`` is the source folder, so their submodules import normally.

Nothing here edits NxD: the source tree is used as published (tag ``v2.28.0``). This module
must never be imported by the pytest process itself (g4's own tests assert that NxD is absent
there); the lane's workers import it first thing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from unittest import mock

STUBBED = ("torch_neuronx", "neuronxcc", "libneuronxla", "torch_xla")


class _StubModule(types.ModuleType):
    """A package whose every missing attribute is a MagicMock."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []  # a package, so that ``import a.b.c`` reaches the finder
        self.__file__ = f"<stub {name}>"

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = mock.MagicMock(name=f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def _bare_package(name: str, path: str) -> None:
    pkg = types.ModuleType(name)
    pkg.__path__ = [path]
    pkg.__file__ = os.path.join(path, "__init__.py")
    pkg.__package__ = name
    sys.modules[name] = pkg


def install(nxd_src: str) -> None:
    """Put NxD's ``src`` folder on ``sys.path`` behind the stubs (idempotent)."""
    if "neuronx_distributed" in sys.modules:
        return
    os.environ["NXD_CPU_MODE"] = "1"
    sys.meta_path.insert(0, _StubFinder())
    import torch_neuronx.utils  # noqa: F401  (a stub)

    sys.modules["torch_neuronx.utils"].get_platform_target = lambda: "trn1"
    sys.path.insert(0, nxd_src)
    root = os.path.join(nxd_src, "neuronx_distributed")
    _bare_package("neuronx_distributed", root)
    _bare_package("neuronx_distributed.trace", os.path.join(root, "trace"))


def install_nxdi(nxd_src: str, nxdi_src: str) -> None:
    """What NxD Inference 0.8's engine additionally needs on a CPU (idempotent):

    - ``neuronx_distributed.trace``'s own ``__init__`` runs (NxDI imports ``ModelBuilder`` and
      ``parallel_model_trace`` from it), so ``torch.classes.neuron`` (read in signatures by
      ``trace/spmd.py`` at import) is a mock;
    - the four NKI names NxD's MoE code turns into values that end up in NxDI's config objects
      (``modules/moe/blockwise.py``: ``BlockShardStrategy``, ``ExpertAffinityScaleMode``,
      ``ActFnType``, ``SkipMode``) are real enums / a small class, not mocks (a mock inside a
      config makes NxDI's ``to_dict`` recurse forever);
    - ``torch_neuronx.__version__`` is a 2.x string: NxD's ``ModelBuilder`` (which NxDI's
      ``get_builder`` makes, for sharding and ``cast_weights`` as well as tracing) asserts it
      (``trace/model_builder.py:461``).
    """
    if "neuronx_distributed_inference" in sys.modules:
        return
    import enum

    import torch

    os.environ["NXD_CPU_MODE"] = "1"
    sys.meta_path.insert(0, _StubFinder())
    import torch_neuronx.utils  # noqa: F401  (a stub)

    sys.modules["torch_neuronx.utils"].get_platform_target = lambda: "trn1"
    sys.modules["torch_neuronx"].__version__ = "2.9.0"
    torch.classes.neuron = mock.MagicMock(name="torch.classes.neuron")
    import neuronxcc.nki._pre_prod_kernels as pre  # noqa: F401  (stubs)
    import neuronxcc.nki._pre_prod_kernels.blockwise_mm as bmm  # noqa: F401

    class ExpertAffinityScaleMode(enum.Enum):
        NO_SCALE = 0
        POST_SCALE = 1
        PRE_SCALE = 2

    class ActFnType(enum.Enum):
        SiLU = 0
        GELU = 1
        GELU_Tanh_Approx = 2
        Swish = 3

    class BlockShardStrategy(enum.Enum):
        HI_LO = 0
        PING_PONG = 1

    class SkipMode:
        def __init__(self, skip_token: bool = False, skip_weight: bool = False):
            self.skip_token, self.skip_weight = skip_token, skip_weight

    pre.ExpertAffinityScaleMode, pre.ActFnType = ExpertAffinityScaleMode, ActFnType
    bmm.BlockShardStrategy, bmm.SkipMode = BlockShardStrategy, SkipMode
    sys.path.insert(0, nxd_src)
    sys.path.insert(0, nxdi_src)
    _bare_package("neuronx_distributed", os.path.join(nxd_src, "neuronx_distributed"))
