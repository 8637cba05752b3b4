"""The code's version and the versions of the packages that can change a number (reports and certificates
record both)."""
from __future__ import annotations

import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The packages whose versions can change a number in the report.
PACKAGES = ("forgetful", "numpy", "scipy", "numba", "polars", "duckdb", "pyarrow", "scikit-learn", "torch",
            "prefect")


def code_version() -> str:
    """The installed package's version and, in a git checkout, its commit."""
    try:
        v = version("forgetful")
    except PackageNotFoundError:
        v = "unknown"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{v}+{rev}" if rev else v


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out
