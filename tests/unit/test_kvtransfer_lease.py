import threading

import pytest

from kvtransfer.lease import LeaseCounters, LeaseTable

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """Records every free, to check that each lease frees exactly once."""

    def __init__(self) -> None:
        self.freed: list[tuple[int, ...]] = []

    def __call__(self, block_ids) -> None:
        self.freed.append(tuple(block_ids))


@pytest.fixture
def setup():
    clock, pool = FakeClock(), Pool()
    return LeaseTable(pool, default_ttl_s=30.0, clock=clock), pool, clock


def test_release_frees_once_and_double_release_is_a_noop(setup):
    table, pool, _ = setup
    lease = table.grant("r1", [3, 7, 1])
    assert table.release(lease.lease_id) is True
    assert table.release(lease.lease_id) is False
    assert table.reject(lease.lease_id) is False
    assert table.expire(now=lease.expiry + 1) == []
    assert pool.freed == [(3, 7, 1)]
    assert table.counters() == LeaseCounters(granted=1, released=1)


def test_reject_frees_once(setup):
    table, pool, _ = setup
    lease = table.grant("r1", [2])
    assert table.reject(lease.lease_id) is True
    assert table.release(lease.lease_id) is False
    assert pool.freed == [(2,)]
    assert table.counters() == LeaseCounters(granted=1, rejected=1)


def test_ttl_expiry_frees_once_and_late_release_is_a_noop(setup):
    table, pool, clock = setup
    short = table.grant("r1", [1, 2], ttl_s=5.0)
    long = table.grant("r2", [3])
    clock.now += 4.9
    assert table.expire() == []
    clock.now += 0.2
    assert [lease.lease_id for lease in table.expire()] == [short.lease_id]
    assert table.expire() == []
    assert table.release(short.lease_id) is False
    assert pool.freed == [(1, 2)]
    assert [lease.lease_id for lease in table.active()] == [long.lease_id]
    assert table.counters() == LeaseCounters(granted=2, expired=1)
    assert table.counters().active == 1


def test_unknown_lease_is_a_noop(setup):
    table, pool, _ = setup
    assert table.release("nope") is False
    assert table.reject("nope") is False
    assert pool.freed == []


def test_lease_for_request_and_duplicate_grant(setup):
    table, _, _ = setup
    lease = table.grant("r1", [4])
    assert table.lease_for("r1") == lease
    with pytest.raises(ValueError, match="already holds"):
        table.grant("r1", [5])
    table.release(lease.lease_id)
    assert table.lease_for("r1") is None
    table.grant("r1", [5])


def test_bad_ttl_is_refused(setup):
    table, _, _ = setup
    with pytest.raises(ValueError, match="ttl_s"):
        table.grant("r1", [1], ttl_s=0)


def test_concurrent_release_reject_and_expiry_free_each_lease_once(setup):
    table, pool, clock = setup
    leases = [table.grant(f"r{i}", [i]) for i in range(200)]
    clock.now += 31
    barrier = threading.Barrier(3)

    def run(fn):
        barrier.wait()
        for lease in leases:
            fn(lease)

    threads = [
        threading.Thread(target=run, args=(lambda lease: table.release(lease.lease_id),)),
        threading.Thread(target=run, args=(lambda lease: table.reject(lease.lease_id),)),
        threading.Thread(target=run, args=(lambda lease: table.expire(),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(pool.freed) == [(i,) for i in range(200)]
    c = table.counters()
    assert c.released + c.rejected + c.expired == 200 and c.active == 0
