"""The load-adaptive CPU thread count (pdserve.engine.cpu_threads), with a fake load sampler."""

import pytest

from pdserve.engine.cpu_threads import ThreadGovernor, runnable_tasks


def governor(samples, max_threads=2, cores=2, window=3):
    it = iter(samples)
    return ThreadGovernor(max_threads, cores=cores, sample=lambda: next(it), window=window)


def test_quiet_machine_uses_every_thread():
    g = governor([1, 1, 1])  # only our own thread runnable
    assert [g.threads() for _ in range(3)] == [2, 2, 2]


def test_one_busy_process_drops_to_one_thread_after_the_median_turns():
    g = governor([1, 2, 2, 2, 1, 1])
    # windows: [0] [0,1] [0,1,1] [1,1,1] [1,1,0] [1,0,0]; median_low of each
    assert [g.threads() for _ in range(6)] == [2, 2, 1, 1, 1, 2]


def test_a_single_burst_is_ignored():
    g = governor([1, 1, 6, 1, 1])
    assert [g.threads() for _ in range(5)] == [2, 2, 2, 2, 2]


def test_never_below_one_nor_above_the_configured_count():
    assert governor([40])._sample() == 40
    assert governor([40]).threads() == 1
    assert governor([1], max_threads=3, cores=8).threads() == 3


def test_no_load_information_keeps_the_configured_count():
    assert governor([None, None]).threads() == 2
    with pytest.raises(ValueError, match="max_threads must be >= 1, got 0"):
        ThreadGovernor(0)


def test_runnable_tasks_reads_this_machine():
    n = runnable_tasks()
    assert n is None or n >= 1  # the reading thread itself is runnable
