"""Error types. Every message names the file and/or tensor and what is wrong, in one line.

The CLI prints ``error: <message>`` and exits with status 2 for any :class:`G4Error`.
"""


class G4Error(Exception):
    """Base class for input and output problems the user can act on."""


class CheckpointError(G4Error, ValueError):
    """The source checkpoint is missing files, corrupt, inconsistent or not Gemma 4."""


class MappingError(G4Error, KeyError):
    """A source tensor has no rule in the target's name table (or a rule has no tensor)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ExportError(G4Error, ValueError):
    """The output would be invalid (non-finite scales, inconsistent metadata) or cannot be placed."""
