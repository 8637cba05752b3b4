"""Who was deleted from a store, from every record that says so, so that no loss brings a patient back.

A deletion writes its subjects' keyed hashes three times: on the store's suppression list, on the workspace's
(``WS/suppressed.json``, beside the deletion log) and in each subject's certificate. A store rebuilt from the
source after a loss, or restored from a backup older than a deletion, has lost or never had the first; the other
two are still there, and the extraction and the run read all three (:func:`deleted_subjects`). A list that
disagrees with the certificates is the sign of such a store (:meth:`DeletedSubjects.missing_from_store`).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .progress import a_few
from .privacy import SUPPRESSED_FILE, suppressed_hashes, workspace_of

CERTIFICATES = "certificates"


@dataclass(frozen=True)
class DeletedSubjects:
    """Keyed hashes of deleted subjects, each with the certificate that deleted them ("" when only a
    suppression list names them); ``in_store``: those the store's own list holds."""
    certificates: dict[str, str]
    in_store: frozenset[str]

    def __contains__(self, subject_hash: str) -> bool:
        return subject_hash in self.certificates

    def __len__(self) -> int:
        return len(self.certificates)

    def missing_from_store(self) -> dict[str, str]:
        """The deleted subjects the store's own list lacks: the store was lost and rebuilt, or restored from a
        backup older than their deletion (it may hold their rows again)."""
        return {h: c for h, c in self.certificates.items() if h not in self.in_store}

    def named(self, hashes: Iterable[str]) -> str:
        """The certificates of ``hashes``, for a message: at most three named, the rest counted."""
        return a_few(sorted({self.certificates.get(h) or "no certificate (a suppression list)" for h in hashes}),
                     joiner=", ")


def certified_hashes(workspace: Path) -> dict[str, str]:
    """Subject hash -> certificate name, for every certificate in the workspace (those of the log and any it no
    longer lists: a certificate in the folder is a deletion that happened, whatever became of the log)."""
    folder = Path(workspace) / CERTIFICATES
    found = {}
    for f in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
        if f.parent.name == "proofs":
            continue
        try:
            h = json.loads(f.read_text()).get("subject_hash")
        except (OSError, ValueError, AttributeError):
            continue        # a damaged certificate is the log's verification's to report; its hash is listed too
        if isinstance(h, str):
            found.setdefault(h, str(f.relative_to(folder)))
    return found


def deleted_subjects(store: Path, workspace: Path | None = None) -> DeletedSubjects:
    """Everyone deleted from ``store``: its suppression list, and where it is a workspace's (``workspace``,
    default :func:`pipeline.privacy.workspace_of`), the workspace's list and certificates."""
    store = Path(store)
    workspace = workspace if workspace is not None else workspace_of(store)
    own = suppressed_hashes(store)
    listed = own | (suppressed_hashes(workspace) if workspace is not None else set())    # WS/suppressed.json
    certified = certified_hashes(workspace) if workspace is not None else {}
    return DeletedSubjects({**dict.fromkeys(listed, ""), **certified}, frozenset(own))


def suppression_files(store: Path, workspace: Path | None) -> list[Path]:
    """Where a deletion writes the suppression list: the store's and its workspace's."""
    return [Path(store) / SUPPRESSED_FILE] + ([Path(workspace) / SUPPRESSED_FILE] if workspace is not None else [])
