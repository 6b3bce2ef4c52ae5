"""Transfer metrics: bytes, durations, failures by reason and rooms by state, also as Prometheus series."""
from __future__ import annotations

from kv_inproc import InProcPair
from prometheus_client import CollectorRegistry, generate_latest

from kv_transfer import FAKE_FAULTS, RoomState, TransferMetrics
from tests.helpers import wait_until


def test_metrics_count_bytes_failures_and_rooms() -> None:
    registry = CollectorRegistry()  # the worker owns the registry
    pair = InProcPair("fake", prefill_metrics=TransferMetrics("prefill", registry))
    try:
        r = pair.decode.create_receiver(1, "127.0.0.1", pair.port)
        r.init([1, 2, 3], aux_slot=0)
        s = pair.prefill.create_sender(1)
        assert wait_until(lambda: s.poll() == RoomState.WAITING_FOR_INPUT, 5)
        s.send([4, 5, 6], last=True, first_token_id=1)
        assert wait_until(lambda: r.poll() == RoomState.SUCCESS, 5)
        kv_bytes = 3 * pair.src.layout.page_bytes * 2 * pair.src.layout.num_layers

        FAKE_FAULTS.fail_writes = True
        try:
            r2 = pair.decode.create_receiver(2, "127.0.0.1", pair.port)
            r2.init([7], aux_slot=1)
            s2 = pair.prefill.create_sender(2)
            assert wait_until(lambda: s2.poll() == RoomState.WAITING_FOR_INPUT, 5)
            s2.send([8], last=True, first_token_id=1)
            assert wait_until(lambda: s2.poll() == RoomState.FAILED and r2.poll() == RoomState.FAILED, 5)
        finally:
            FAKE_FAULTS.fail_writes = False
        assert s2.failure.kind.value == "transfer_io" and "injected" in s2.failure_reason
        assert r2.failure.kind.value == "transfer_io"

        snap = pair.decode.metrics.snapshot()
        assert snap["bytes_total"] == kv_bytes and snap["transfers_total"] == 1
        assert snap["failures"] == {"transfer_io": 1}
        text = generate_latest(registry).decode()
        assert f'splitserve_kv_transfer_bytes_total{{role="prefill"}} {float(kv_bytes)}' in text
        assert 'splitserve_kv_transfer_failures_total{reason="transfer_io",role="prefill"} 1.0' in text
        assert 'splitserve_kv_transfer_duration_seconds_count{role="prefill"} 1.0' in text
        assert pair.decode.rooms_by_state()[RoomState.SUCCESS] == 1
        s2.release()
    finally:
        pair.close()
