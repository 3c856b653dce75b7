"""A quantizer's one-pass kernel compiled by ``torch.compile`` (inductor, C++/OpenMP on the CPU),
with the eager fallback both quantizers share.

The kernel is compiled on first use, static in the input width and dynamic in the rows (the
caller marks the rows dynamic). It is not used for tensors under ``min_elements`` (no compile
for small test models), when the ``eager_env`` variable is set to anything but ``0``, or once
a compile or run has failed (no C compiler, a codegen error): the caller's eager path then
gives the same bytes, which the quantizers' tests check.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_UNSET = object()


class CompiledKernel:
    """``fn`` compiled on first use, or None where it must not or cannot run.

    Args:
        fn: the one definition of the arithmetic (run eagerly by the caller otherwise).
        eager_env: environment variable that forces the eager path (e.g. ``G4_NVFP4_EAGER``).
        label: the quantizer's name in log lines.
        min_elements: smallest tensor (elements) worth the compiled kernel.

    Attributes:
        compiled: the compiled function, None (eager only), or unset until first use; tests
            set it to None to run the eager path.
    """

    def __init__(self, fn: Callable, *, eager_env: str, label: str, min_elements: int = 1 << 20):
        self.fn, self.eager_env, self.label, self.min_elements = fn, eager_env, label, min_elements
        self.compiled = _UNSET

    def for_size(self, numel: int) -> Callable | None:
        """The compiled kernel for a tensor of ``numel`` elements, or None for the eager path."""
        if numel < self.min_elements:
            return None
        if self.compiled is _UNSET:
            self.compiled = None
            if os.environ.get(self.eager_env, "") in ("", "0"):
                try:
                    self.compiled = torch.compile(self.fn, dynamic=False)
                except Exception as e:  # noqa: BLE001 - torch.compile raises many types
                    log.warning("%s: torch.compile unavailable (%s); using the eager quantizer", self.label, e)
        return self.compiled

    def disable(self, e: Exception) -> None:
        """After a failed compile or run: log it once and use the eager path from now on."""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        log.warning("%s: compiled quantizer failed (%s: %s); using the eager quantizer", self.label,
                    type(e).__name__, first)
        self.compiled = None
