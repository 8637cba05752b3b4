"""The deletion certificate as one typed record: written by :meth:`Certificate.text` (RFC 8785 canonical JSON, what
the log hashes) and read by :meth:`Certificate.read`, with a schema version.

It lives below the deletion that issues it and the report that renders it, so that both, and the flows that
name it, hold the same record instead of a dict each reads with its own defaults. Schema 1 is every certificate
issued before the version was recorded (the same fields, no ``schema``); a migration's certificate (the log's
first entry after a format-1 workspace is migrated) is another kind of record and is not read here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import InputError
from .evidence import canonical

SCHEMA = 2


@dataclass(frozen=True)
class Certificate:
    """One patient's deletion: only what was done and checked. ``removed``: their rows and tokens per place;
    ``verification`` and ``memory_digests``: each memory's refit check and state digests (of the transaction,
    which ``deleted_together`` counts); ``residual_scan``: the post-deletion scan; ``never_saw_equivalence``:
    which artifacts equal a run that never saw them; ``log_size_before``/``log_root_before``: the log it was
    appended to."""
    certificate_id: int
    subject_hash: str
    deleted_together: dict
    hash: str
    mode: str
    mode_meaning: str
    removed: dict
    memory_digests: dict
    verification: dict
    residual_scan: dict
    artifacts_marked_stale: list
    recomputed_without_the_patient: list
    never_saw_equivalence: dict
    code_version: str
    issued_at: str
    seconds: float
    log_size_before: int
    log_root_before: str
    schema: int = SCHEMA

    def as_json(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """The certificate as issued: canonical JSON (the log's entry holds its SHA-256)."""
        return canonical(self.as_json())

    @classmethod
    def from_json(cls, raw: dict, where: str = "a certificate") -> Certificate:
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(raw) - {"schema"})
        if missing or set(raw) - names:
            raise InputError(f"{where} is not a deletion certificate of this release's schemas (missing "
                             f"{missing}, unknown {sorted(set(raw) - names)})")
        return cls(**{"schema": 1, **raw})

    @classmethod
    def read(cls, path: Path) -> Certificate:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"certificate {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(raw, dict):
            raise InputError(f"certificate {path} is not a JSON object")
        return cls.from_json(raw, f"certificate {path}")
