"""Engine cores lending each other their idle cores (engine/core_share.py): a team is
as big as its pool allows while the others idle, and its share while they are busy; a
stale busy mark and a dead engine's slot free their cores."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from engine.core_share import _SLOT, BUSY_FOR_S, CoreShare

pytestmark = pytest.mark.unit


@pytest.fixture
def table(tmp_path):
    return tmp_path / "cores"


def test_an_engine_alone_uses_its_threads_and_no_more_than_the_cores(table):
    a = CoreShare(max_threads=2, path=table, cores=2)
    assert a.busy() == 2
    assert CoreShare(max_threads=4, path=table, cores=2).busy() == 1  # a is busy: one core left
    a.close()


def test_a_busy_neighbour_takes_its_share_and_an_idle_one_lends_it(table):
    prefill = CoreShare(max_threads=2, path=table, cores=2)
    decode = CoreShare(max_threads=2, path=table, cores=2)
    assert decode.busy() == 2  # prefill has not stepped yet
    assert prefill.busy() == 1  # decode is stepping
    assert decode.busy() == 1
    prefill.idle()
    assert decode.busy() == 2
    decode.idle()
    assert prefill.busy() == 2
    prefill.close()
    decode.close()


def test_a_team_follows_its_neighbour_in_the_middle_of_a_step(table):
    prefill = CoreShare(max_threads=2, path=table, cores=2)
    decode = CoreShare(max_threads=2, path=table, cores=2)
    assert decode.busy() == 2  # a decode step starts alone
    assert decode.threads_now() == 2
    prefill.busy()  # a prefill step starts inside it: decode hands a core back
    assert decode.threads_now() == 1
    prefill.idle()  # and takes it again when that prefill step ends
    assert decode.threads_now() == 2
    prefill.close()
    decode.close()


def test_never_fewer_than_one_thread(table):
    others = [CoreShare(max_threads=1, path=table, cores=2) for _ in range(3)]
    for o in others:
        o.busy()
    assert CoreShare(max_threads=2, path=table, cores=2).busy() == 1


def test_a_stale_busy_mark_counts_as_idle(table):
    a = CoreShare(max_threads=2, path=table, cores=2)
    b = CoreShare(max_threads=2, path=table, cores=2)
    b.busy()
    assert a.busy() == 1
    # b's step "started" longer ago than any step lasts (it died mid-step, say).
    stale = time.monotonic_ns() - int((BUSY_FOR_S + 1) * 1e9)
    _SLOT.pack_into(b._table, b._slot * _SLOT.size, os.getpid(), stale)
    assert a.busy() == 2


def test_a_dead_engines_slot_is_taken_by_the_next(table):
    gone = subprocess.Popen(["true"])
    gone.wait()
    first = CoreShare(max_threads=2, path=table, cores=2)
    _SLOT.pack_into(first._table, first._slot * _SLOT.size, gone.pid, time.monotonic_ns())  # a dead engine, busy
    second = CoreShare(max_threads=2, path=table, cores=2)
    assert second._slot == first._slot  # reclaimed
    assert second.busy() == 2
    first._table.close()
    second.close()
