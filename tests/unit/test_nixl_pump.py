"""The NIXL agent's pump progresses the target side every 2 ms only while a lease may
be pulled (`expect_reads` until `reads_ended`), and every 100 ms otherwise: an idle replica's pump woke
500 times a second and cost ~4% of a core."""

import time

import pytest
import torch

pytestmark = pytest.mark.unit
nixl_backend = pytest.importorskip("kvtransfer.backends.nixl_backend")


def test_the_pump_is_fast_only_while_reads_are_expected():
    with nixl_backend.NixlBackend("prefill#pump", "m") as b:
        b.register(torch.zeros(4, 2, 2, 16, 1, 8))
        assert b.pump_interval_s == 0.1
        b.expect_reads(60.0)
        assert b.pump_interval_s == 0.002
        b.expect_reads(0.0)  # a shorter lease never cuts a longer one short
        assert b.pump_interval_s == 0.002
        b.reads_ended()  # the last lease ended
        assert b.pump_interval_s == 0.1


def test_the_pump_slows_down_when_the_leases_have_run_out():
    with nixl_backend.NixlBackend("prefill#pump2", "m") as b:
        b.register(torch.zeros(4, 2, 2, 16, 1, 8))
        b.expect_reads(0.05)
        assert b.pump_interval_s == 0.002
        deadline = time.monotonic() + 10
        while b.pump_interval_s != 0.1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.pump_interval_s == 0.1


def test_no_pump_stays_no_pump():
    with nixl_backend.NixlBackend("prefill#pump3", "m", progress_interval_s=None) as b:
        b.expect_reads(60.0)
        assert b.pump_interval_s is None
