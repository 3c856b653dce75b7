"""A quantizer's one-pass kernel compiled by ``torch.compile`` (inductor, C++/OpenMP on the CPU),
with the eager fallback both quantizers share.

The kernel is compiled on first use, static in the input width and dynamic in the rows (the
caller marks the rows dynamic). It is not used for tensors under ``min_elements`` (no compile
for small test models), when the ``eager_env`` variable is set to anything but ``0``, or once
a compile or run has failed (no C compiler, a codegen error): the caller's eager path then
gives the same bytes, which the quantizers' tests check.

A conversion can compile its kernels in the background while it reads (:meth:`CompiledKernel.warm`):
in a fresh process the first compile costs seconds even with inductor's on-disk cache (importing
dynamo and inductor, inductor's probe of the CPU's vector instructions, which runs child processes,
and loading each width's compiled code), time the conversion's reads of its first tensors can cover.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

log = logging.getLogger(__name__)

_UNSET = object()
# Rows of the zeros CompiledKernel.warm_rows compiles on (dynamic: 0 and 1 would be specialised).
WARM_ROWS = 64


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
        self._lock = threading.Lock()  # the first for_size() call may come from two threads (warm())
        self._warming: threading.Thread | None = None

    def for_size(self, numel: int) -> Callable | None:
        """The compiled kernel for a tensor of ``numel`` elements, or None for the eager path;
        waits for a :meth:`warm` thread to finish first."""
        if numel < self.min_elements:
            return None
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
            if self._warming is warming:  # not a warm() started meanwhile
                self._warming = None
        with self._lock:
            if self.compiled is _UNSET:
                compiled = None
                if os.environ.get(self.eager_env, "") in ("", "0"):
                    try:
                        compiled = torch.compile(self.fn, dynamic=False)
                    except Exception as e:  # noqa: BLE001 - torch.compile raises many types
                        log.warning("%s: torch.compile unavailable (%s); using the eager quantizer", self.label, e)
                self.compiled = compiled
        return self.compiled

    def warm(self, examples: Iterable[tuple]) -> threading.Thread | None:
        """Compile the kernel for each argument tuple of ``examples`` (small tensors of the real
        inputs' dtypes, static sizes and dynamic marks, so the real calls find the compiled code
        by its guards) by running it once on them, in order, in a daemon thread; returns the
        thread (join it to wait), or None where the kernel is not compiled (``eager_env`` set, no
        ``torch.compile``). ``examples`` is iterated in that thread (a generator can build its
        tensors there: marking a dimension dynamic imports dynamo, seconds of the caller's time).
        A failure there is left to the real call, which then falls back to the eager path
        (:meth:`disable`). The first real call (:meth:`for_size`) waits for the thread: called
        while dynamo compiles the same function in another thread, it waited for that compile and
        then traced and compiled again (``torch._dynamo.convert_frame``); a second warm() starts
        once the first has finished, so waiting for the last waits for both."""
        if os.environ.get(self.eager_env, "") not in ("", "0") or self.compiled is None:
            return None
        previous = self._warming

        def run() -> None:
            try:
                if previous is not None:
                    previous.join()
                for args in examples:
                    if (fused := self.for_size(self.min_elements)) is None:
                        return
                    fused(*args)
            except Exception as e:  # noqa: BLE001 - the real call meets it again and falls back
                log.debug("%s: warming the compiled kernel failed (%s)", self.label, e)

        thread = self._warming = threading.Thread(target=run, name=f"g4-compile-{self.label}", daemon=True)
        thread.start()
        return thread

    def warm_rows(self, inputs: Iterable[tuple[int, tuple[int, ...], torch.dtype]], *extra: torch.Tensor
                  ) -> threading.Thread | None:
        """:meth:`warm` for a kernel whose first argument is dynamic in its first dimension (the
        rows) and static in the others: ``inputs`` holds ``(numel, tail, dtype)`` of each real
        first argument (its element count, its shape without the rows, its dtype; in the order
        of first use); one compile per ``(tail, dtype)`` among those of at least ``min_elements``,
        on :data:`WARM_ROWS` rows of zeros marked dynamic in the rows (as the callers mark their
        real inputs), followed by ``extra`` arguments. Returns the thread, or None (nothing to
        compile, or :meth:`warm`'s None)."""
        given = list(dict.fromkeys((tuple(tail), dtype) for numel, tail, dtype in inputs if numel >= self.min_elements))

        def examples() -> Iterator[tuple[torch.Tensor, ...]]:  # run in the thread: marking imports dynamo
            for tail, dtype in given:
                x = torch.zeros(WARM_ROWS, *tail, dtype=dtype)
                torch._dynamo.maybe_mark_dynamic(x, 0)
                yield (x, *extra)

        return self.warm(examples()) if given else None

    def disable(self, e: Exception) -> None:
        """After a failed compile or run: log it once and use the eager path from now on."""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        log.warning("%s: compiled quantizer failed (%s: %s); using the eager quantizer", self.label,
                    type(e).__name__, first)
        self.compiled = None
