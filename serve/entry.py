"""The ``g4serve`` console script: start-up signals handled before the heavy imports of
:mod:`g4.serve.cli` (:func:`g4.core.errors.guard_start_up`)."""

from g4.core.errors import guard_start_up


def g4serve() -> None:
    """Entry point of ``g4serve``."""
    guard_start_up()
    from g4.serve.cli import main

    main()
