"""`plot_process`: a plot drawn in the command's plot process is the file drawn here, byte for byte; what it
raises there is raised here; without a process, plots are drawn here."""

import os
import signal

import numpy as np
import pytest

from evalsuite import plot_process, plots


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
