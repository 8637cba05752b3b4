"""What an SV memory states about itself: its KKT partition, eviction certificates and the state digest."""
import hashlib
import struct
from dataclasses import dataclass
from operator import itemgetter

import numpy as np


@dataclass(frozen=True)
class Partition:
    """Token ids by KKT set."""
    margin: frozenset
    bound: frozenset
    reserve: frozenset


@dataclass(frozen=True)
class EvictionCertificate:
    """Proof that evicting ``token_id`` leaves the memory's output unchanged.

    ``alpha`` is the stored coefficient (exactly 0.0), ``decision_value`` the token's g (>= 0), ``margin`` its
    distance above the boundary in g-units, ``strictly_complementary`` whether that margin exceeds ``tau_res``
    (a token on the boundary is output-preserving now but degenerate). ``kkt_residual_after`` is the residual
    of the state without the token; the digests identify the state before and after eviction.

    The readout (``read``) is bit-for-bit unchanged. So is the decision function when ``rho_pinned`` (the margin
    set is non-empty); otherwise rho is only bounded, and is moved to the midpoint of its interval without
    the token, the convention the refit uses (coefficients and readout are unchanged either way).
    """
    token_id: object
    alpha: float
    decision_value: float
    margin: float
    tau_res: float
    strictly_complementary: bool
    rho_pinned: bool
    kkt_residual_after: float
    digest_before: str | None     # None: issued without digests (SVMemory.certify_eviction's ``digests``)
    digest_after: str | None

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["token_id"] = repr(self.token_id)
        return d


def state_digest(C: float, gamma: float, rho: float, leaves: list, coefficients: np.ndarray) -> str:
    """SHA-256 over a solution state: C, gamma, rho, the atoms' digest leaves and their per-token coefficients,
    atoms in creation order."""
    h = hashlib.sha256()
    h.update(struct.pack("<3d", C, gamma, rho))
    h.update(b"".join(leaves))
    h.update(np.ascontiguousarray(coefficients, dtype=np.float64).tobytes())
    return h.hexdigest()


def leaves_in_order(leaves: list, order: np.ndarray) -> list:
    """``leaves[i]`` for i in ``order`` (itemgetter: one call instead of a Python loop per atom)."""
    return [leaves[i] for i in order] if len(order) < 2 else list(itemgetter(*order)(leaves))
