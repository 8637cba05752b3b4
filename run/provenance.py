"""Where a run's numbers come from: the source files and their checksums, the code, the packages, the config."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cohorts.definitions import workspace_config_path
from pipeline.extract import load_manifest
from pipeline.versions import code_version, package_versions


@dataclass(frozen=True)
class SourceFile:
    table: str
    path: str
    sha256: str
    rows: int
    size: int


@dataclass(frozen=True)
class Provenance:
    source: str
    files: tuple[SourceFile, ...]        # as of the store's latest extraction
    extractions: int                     # extraction runs that built the store
    code_version: str
    packages: dict[str, str]
    config_path: str
    config_sha256: str
    config_text: str


def provenance(store: Path, root: Path, source: str) -> Provenance:
    """The provenance of a run over the workspace ``root`` whose store is ``store``, read from ``source``."""
    manifest = load_manifest(store)
    files = tuple(SourceFile(t, str(f["path"]), f["sha256"], int(f.get("rows", 0)), int(f["size"]))
                  for t, f in sorted(manifest["files"].items()))
    cfg = workspace_config_path(root)
    text = cfg.read_text()
    where = Path(source)
    return Provenance(str(where.resolve()) if where.exists() else source, files, len(manifest["runs"]),
                      code_version(), package_versions(), str(cfg), hashlib.sha256(text.encode()).hexdigest(), text)
