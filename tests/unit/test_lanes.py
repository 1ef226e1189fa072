"""The suite's lanes (helpers/lanes.py) with the pytest and pytest-xdist this project pins: a synthetic
suite on two real workers, where the heavy modules must all run on one worker, in one piece each, and
a module that runs alone must have no test beside it but those of light modules, and a module kept apart
no test of the heavy lane."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
CONFTEST = f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers import lanes
HEAVY = ("test_heavy_a.py", "test_heavy_b.py", "test_heavy_c.py")
ALONE = ("test_alone_a.py", "test_alone_b.py")
LIGHT = ("test_unit_",)
APART = ("test_apart_a.py", "test_apart_b.py")
def pytest_xdist_make_scheduler(config, log):
    return lanes.make_scheduler(config, log, HEAVY, ALONE, LIGHT, APART)
def pytest_collection_modifyitems(items):
    lanes.order(items, HEAVY, ALONE, LIGHT, APART)
'''
# Each test notes when it ran: (module, start, end) on the clock both workers share.
MODULE = '''import time
from pathlib import Path
def _note(start):
    with open(Path(__file__).parent / "ran.txt", "a") as f:
        f.write(f"{{Path(__file__).stem}} {{start}} {{time.time()}}\\n")
''' + "".join(f"def test_{i}():\n    start = time.time()\n    time.sleep({{sleep}})\n    _note(start)\n" for i in range(3))


@pytest.mark.timeout(120)
def test_heavy_modules_share_one_worker_and_modules_that_run_alone_or_apart_keep_their_distance(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    names = ("heavy_a", "heavy_b", "heavy_c", "swarm_a", "swarm_b", "swarm_c", "apart_a", "apart_b", "alone_a",
             "alone_b", "unit_a", "unit_b", "unit_c", "unit_d")
    sleeps = {"heavy": 0.1, "swarm": 0.05, "apart": 0.1, "alone": 0.2, "unit": 0.1}
    for name in names:
        (tmp_path / f"test_{name}.py").write_text(MODULE.format(sleep=sleeps[name.split("_")[0]]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadscope", "-v", "-p", "no:cacheprovider",
                          "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .* PASSED (test_\w+)\.py::test_(\d)", run.stdout, re.M)
    assert len(ran) == 3 * len(names), run.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, module, _ in ran:
        workers.setdefault(module, set()).add(worker)
    # A module runs whole on one worker, every heavy module on the same one, and the other worker
    # starts on the other modules meanwhile.
    assert all(len(w) == 1 for w in workers.values()), workers
    heavy = {w for m, ws in workers.items() if m.startswith("test_heavy") for w in ws}
    others = {w for m, ws in workers.items() if m.startswith("test_swarm") for w in ws}
    assert len(heavy) == 1 and others - heavy, workers
    # While a test of a module that runs alone ran, only tests of light modules ran beside it.
    spans = [(m, float(a), float(b)) for m, a, b in (line.split() for line in (tmp_path / "ran.txt").read_text().splitlines())]
    for module, start, end in spans:
        if module.startswith("test_alone"):
            beside = [(m, a, b) for m, a, b in spans if m != module and a < end and b > start and not m.startswith("test_unit")]
            assert not beside, (module, start, end, beside)
        if module.startswith("test_apart"):  # ... and while one kept apart ran, no heavy one did
            beside = [(m, a, b) for m, a, b in spans if a < end and b > start and m.startswith("test_heavy")]
            assert not beside, (module, start, end, beside)
