"""Shared test helpers: where the read-only fixtures live (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def fixtures_dir() -> Path | None:
    """$TOKENMILL_FIXTURES, else ../shared/fixtures next to the repo, else /work/shared/fixtures."""
    candidates = [os.environ.get("TOKENMILL_FIXTURES"),
                  Path(__file__).resolve().parents[2] / "shared" / "fixtures",
                  "/work/shared/fixtures"]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return None


@pytest.fixture(scope="session")
def fixtures() -> Path:
    path = fixtures_dir()
    if path is None:
        pytest.skip("test fixtures not found: set TOKENMILL_FIXTURES or provide "
                    "../shared/fixtures next to the repository")
    return path
