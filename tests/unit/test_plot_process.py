"""`plot_process`: a plot drawn in the command's plot process is the file drawn here, byte for byte; what it
raises there is raised here; without a process, plots are drawn here."""

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evalsuite.plotting import plot_process, plots


@pytest.fixture
def started():
    plot_process.start()
    yield
    plot_process.stop()


@plot_process.drawn_here_or_there
def which_process(path) -> None:
    """Writes the id of the process it ran in (marked at its definition, as the plot functions are: the
    plot process finds it by its name)."""
    path.write_text(str(os.getpid()))


def test_a_plot_drawn_in_the_plot_process_is_the_same_file(tmp_path, started):
    kld = np.random.default_rng(0).exponential(0.3, size=500)
    plots.kld_histogram(kld, tmp_path / "there.png", "exact")
    plot_process.stop()
    plots.kld_histogram(kld, tmp_path / "here.png", "exact")
    assert (tmp_path / "there.png").read_bytes() == (tmp_path / "here.png").read_bytes()


def test_the_plot_process_is_another_process_and_raises_here_what_it_raised_there(tmp_path, started):
    which_process(tmp_path / "pid")
    assert int((tmp_path / "pid").read_text()) != os.getpid()
    with pytest.raises(FileNotFoundError):
        which_process(tmp_path / "no such folder" / "pid")


def test_without_a_plot_process_plots_are_drawn_here(tmp_path):
    which_process(tmp_path / "pid")
    assert int((tmp_path / "pid").read_text()) == os.getpid()


def test_the_plot_process_leaves_ctrl_c_to_the_command(tmp_path, started):
    # A terminal's Ctrl-C reaches the whole process group: the plot process must go on (and print nothing).
    which_process(tmp_path / "pid")
    worker = int((tmp_path / "pid").read_text())
    os.kill(worker, signal.SIGINT)
    which_process(tmp_path / "again")
    assert int((tmp_path / "again").read_text()) == worker


# A command that starts the plot process, has it write its process id, then waits to be killed.
_COMMAND = """
import sys, time
from pathlib import Path
from evalsuite.plotting import plot_process
sys.path.insert(0, sys.argv[2])
from test_plot_process import which_process
plot_process.start()
which_process(Path(sys.argv[1]))
print("ready", flush=True)
time.sleep(600)
"""


def test_the_plot_process_ends_with_a_command_killed_outright(tmp_path):
    pid_file = tmp_path / "pid"
    command = subprocess.Popen(
        [sys.executable, "-c", _COMMAND, str(pid_file), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert command.stdout is not None and command.stdout.readline().strip() == "ready"
    worker = int(pid_file.read_text())
    command.kill()  # SIGKILL: nothing of the command's own clean-up runs
    command.wait()
    # The worker holds the command's stdout until it ends: end of file on it says the worker is gone. (One
    # that outlived the command would hold it open for ever; the wait is bounded only so as to say so.)
    ready, _, _ = select.select([command.stdout], [], [], 120)
    assert ready and command.stdout.read() == "", f"the plot process {worker} outlived the command"


def test_where_no_process_can_be_started_plots_are_drawn_here(tmp_path, monkeypatch):
    def no_semaphores(*args, **kwargs):
        raise OSError(38, "Function not implemented")  # as sem_open fails where /dev/shm is missing

    monkeypatch.setattr(plot_process, "ProcessPoolExecutor", no_semaphores)
    plot_process.start()
    which_process(tmp_path / "pid")
    assert int((tmp_path / "pid").read_text()) == os.getpid()
