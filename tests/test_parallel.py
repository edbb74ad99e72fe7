"""windowed_map: bounded, ordered, and nothing left running once its consumer stops."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mfsreg.registry.parallel import windowed_map


def test_results_come_in_order_with_a_bounded_window():
    in_flight = peak = 0
    lock = threading.Lock()

    def fn(i):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.002 * (i % 3))
        with lock:
            in_flight -= 1
        return i * i

    with ThreadPoolExecutor(4) as pool:
        assert list(windowed_map(pool, fn, range(40), window=3)) == [i * i for i in range(40)]
    assert peak <= 3


def test_a_consumer_that_stops_early_leaves_no_job_running():
    """Callers close the buffers (mmaps) that jobs read right after they stop consuming."""
    done = []

    def fn(i):
        time.sleep(0.05)
        done.append(i)
        return i

    with ThreadPoolExecutor(2) as pool:
        it = windowed_map(pool, fn, range(10), window=4)
        assert next(it) == 0
        it.close()
        finished = len(done)
        time.sleep(0.3)
        assert len(done) == finished  # nothing was still running after close()
        assert finished < 10  # jobs that had not started were dropped


def test_an_error_in_a_job_reaches_the_consumer_after_the_others_stop():
    started = []

    def fn(i):
        started.append(i)
        if i == 1:
            raise ValueError("bad chunk")
        time.sleep(0.05)
        return i

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="bad chunk"):
            list(windowed_map(pool, fn, range(10), window=4))
        n = len(started)
        time.sleep(0.2)
        assert len(started) == n
