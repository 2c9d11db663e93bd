"""A step's team (kernels/csrc/team.h): the fused step's parallel loops as jobs whose parts any
member claims, so a member the OS has descheduled holds up only the part it is running. Compiled
alone with OpenMP and run with four members (tests/csrc/team.cpp): every part of every job runs
once, a job returns only when its parts are done, loops inside a part run inline, a member 20x
slower runs few parts, and 20,000 jobs with pauses (members asleep, then woken) lose none."""

import subprocess
from pathlib import Path

import pytest

from tests.conftest import build_loops_program
from tokenmill.kernels import build

SOURCE = Path(__file__).parent / "csrc" / "team.cpp"


@pytest.mark.skipif(not build.compiler(), reason="needs a C++ compiler")
def test_team_jobs(tmp_path):
    exe = tmp_path / "team"
    build_loops_program(SOURCE, exe)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert not [x for x in lines if x.startswith("bad")], proc.stdout
    assert proc.returncode == 0
    assert [x.split()[1] for x in lines] == ["parallel_for", "parallel_dynamic", "parallel_steal",
                                             "waits", "many", "done"]
