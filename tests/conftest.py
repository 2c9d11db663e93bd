"""Shared test helpers: where the read-only fixtures live (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One PyTorch thread unless told otherwise: the models here are tiny or small, and on a busy
# 2-core machine OpenMP's spin-waiting made 2 threads up to 7x slower than 1 (measured).
torch.set_num_threads(int(os.environ.get("TOKENMILL_TEST_THREADS", "1")))


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
