"""The conversions' progress bar: log lines written while it is shown go above it.

A plain ``logging.StreamHandler`` on stderr would print a layer's log line onto the bar's
line (tqdm redraws it with ``\\r``, without a newline); :func:`progress_bar` routes the root
logger's console handlers through ``tqdm.write`` for as long as the bar is open
(``tqdm.contrib.logging.logging_redirect_tqdm``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


@contextmanager
def progress_bar(total: int, desc: str, *, enabled: bool = True, unit: str = "B") -> Iterator[tqdm]:
    """A tqdm bar counting ``total`` bytes (or ``unit``s, e.g. ``"layer"``), closed on exit (also on
    errors); while it is open, log records reach the console through ``tqdm.write``, above the bar."""
    with logging_redirect_tqdm(), tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc,
                                       disable=not enabled) as bar:
        yield bar
