"""Exact support-vector memory, its baselines and its torch layer."""
from .errors import InfeasibleError, InvalidKeyError, NotCertifiableError, SolverError, UnknownTokenError
from .refit import RefitReport, verify_against_refit
from .svmemory import EvictionCertificate, Partition, SVMemory

__all__ = ["SVMemory", "EvictionCertificate", "Partition", "RefitReport", "verify_against_refit",
           "InfeasibleError", "InvalidKeyError", "NotCertifiableError", "SolverError", "UnknownTokenError"]
