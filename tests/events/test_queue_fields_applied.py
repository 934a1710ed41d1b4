"""The queue fields of a load event reach the worker's rank over real ZMQ; a bad one drops
the whole event."""

from __future__ import annotations

from extproc.core.worker import Worker
from tests.events.test_subscriber import CFG, _join, _setup, _until, counter, mp


async def test_queue_fields_are_stored_on_the_rank_and_a_bad_one_drops_the_event() -> None:
    pool, metrics, sub, pub = await _setup()
    told: list[Worker] = []
    pool.on_load = told.append
    try:
        await _join(pool, pub)
        await pub.send_multipart([b"config", mp({**CFG, "kv_total_blocks": 100})])
        load = {"v": 1, "worker_id": "w", "active_decode_blocks": 5}
        queue = {"num_requests_waiting": 3, "request_active_slots": 2, "request_total_slots": 2}
        await pub.send_multipart([b"load", mp({**load, **queue})])
        await _until(lambda: pool.workers["w"].ranks[0].reported_waiting == 3)
        rank = pool.workers["w"].ranks[0]
        assert (rank.reported_active_slots, rank.reported_total_slots) == (2, 2)
        assert any(w.worker_id == "w" for w in told)
        # A negative count drops the whole event: the KV load it carries is not applied.
        bad = {**load, "active_decode_blocks": 50, "num_requests_waiting": -1}
        await pub.send_multipart([b"load", mp(bad)])
        await pub.send_multipart([b"load", mp({**load, "active_decode_blocks": 6, **queue})])
        await _until(lambda: pool.workers["w"].ranks[0].reported_blocks == 6)
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "bad_schema"}) == 1
        assert rank.reported_waiting == 3
    finally:
        sub.close()
        pub.close()
