"""Exceptions raised by the SV memory; each names the offending quantity."""


class MemoryError_(Exception):
    """Base class of every error the SV memory raises."""


class InfeasibleError(MemoryError_, ValueError):
    """The fixed-box problem has no feasible point: n * C < 1."""


class InvalidKeyError(MemoryError_, ValueError):
    """A key (or value) is non-finite or has the wrong dimension."""


class UnknownTokenError(MemoryError_, KeyError):
    """A token id that the memory does not hold."""

    def __str__(self):  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0]) if self.args else ""


class NotCertifiableError(MemoryError_, ValueError):
    """Eviction was asked for a token that is not in the reserve set."""


class SolverError(MemoryError_, RuntimeError):
    """The exact solver could not reach a KKT point within its tolerance."""
