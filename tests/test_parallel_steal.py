"""parallel_steal (kernels/csrc/common.h), the split of the GEMMs' work items: each thread takes
its own run from the front and, when done, the others' runs from their backs, so a core slowed
by a neighbour hands its last items to a faster one. Compiled alone with OpenMP and run with
four threads, the last one 20x slower per item."""

import subprocess
from pathlib import Path

import pytest

from tests.conftest import build_loops_program
from tokenmill.kernels import build

SOURCE = Path(__file__).parent / "csrc" / "parallel_steal.cpp"


@pytest.mark.skipif(not build.compiler(), reason="needs a C++ compiler")
def test_every_item_once_and_the_slow_threads_run_shrinks(tmp_path):
    exe = tmp_path / "steal"
    build_loops_program(SOURCE, exe)
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    lines = lines.split("\n")
    assert not [x for x in lines if x.startswith("bad")]
    rows = [tuple(map(int, x.split())) for x in lines if x]
    assert len(rows) == 203 and all(taken == 1 for _, taken in rows)
    owners = [o for o, _ in rows]
    chunk = (203 + 3) // 4  # runs as parallel_for splits them: 51, 51, 51, 50
    slow_run = owners[3 * chunk:]
    assert slow_run[0] == 3  # the slow thread starts its own run from the front
    assert slow_run.count(3) < len(slow_run) // 2  # and the others took most of it
    # what the slow thread kept is a prefix of its run: the others took from the back
    kept = slow_run.count(3)
    assert slow_run[:kept] == [3] * kept
    assert {0, 1, 2} <= set(owners[:3 * chunk])
