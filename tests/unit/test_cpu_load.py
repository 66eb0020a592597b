"""The CPU clocks read /proc/stat for real: another process's work shows in others_busy_s."""

import subprocess
import sys
import time

import pytest

from tandem.cpu_load import machine_busy_s, others_busy_s

pytestmark = pytest.mark.skipif(machine_busy_s() is None, reason="no /proc/stat here")


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_machine_busy_clock_counts_this_process_own_work():
    busy, own = machine_busy_s(), time.process_time()
    _spin(0.5)
    assert machine_busy_s() - busy >= 0.8 * (time.process_time() - own)


def test_another_process_work_shows_in_the_others_clock():
    code = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"
    before = others_busy_s()
    subprocess.run([sys.executable, "-c", code], check=True)
    assert others_busy_s() - before >= 0.8  # its second of CPU (and its start) is not ours
