"""The ``g4convert`` console script: start-up signals handled before the heavy imports of
:mod:`g4.convert.cli` (torch, transformers), so Ctrl-C while starting prints one line, not a
traceback (:func:`g4.core.errors.guard_start_up`)."""

from g4.core.errors import guard_start_up


def g4convert() -> None:
    """Entry point of ``g4convert``."""
    guard_start_up()
    from g4.convert.cli import main

    main()
