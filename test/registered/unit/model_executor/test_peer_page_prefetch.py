"""LayerPipeline: the order of prefetches, waits and slot uses that the ordering rule requires.

The slot data itself is checked end to end across gloo ranks (``test_cp_shared_kv_runtime_gloo``);
here the pipeline's calls are recorded on one process: each prefetch of layer ``l+1`` is issued at
layer ``l``'s first store, right after the side stream was made to wait for the compute stream, into
slot ``(l+1) % 2``, with indexer K only for layers that store it; nothing is prefetched past the
last layer, for decode or for a plan larger than slot 1 (which is logged once).

Planted and seen failing: prefetching two layers ahead (``layer_id + 2``), and issuing the prefetch
before the side stream's wait.
"""

import logging
import unittest
from types import SimpleNamespace

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.peer_page_prefetch import INDEX, KV, LayerPipeline

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

PAGE = 64


def _slot(pages):
    return SimpleNamespace(size=(pages - 1) * PAGE, page_size=PAGE)


def _pipeline(layers=4, indexer_layers=frozenset({0, 1, 3}), slot1_pages=100):
    pool = SimpleNamespace(device="cpu", start_layer=0, layer_num=layers, layer_transfer_counter=None)
    pipeline = LayerPipeline(pool, [_slot(1000), _slot(slot1_pages)], "group", indexer_layers)
    log = []
    pipeline.side_waits_for_compute = lambda: log.append("side waits")
    pipeline.wait_for_load_back = lambda index: log.append(("load-back", index))
    pipeline.gather_into = lambda slot, layer_id, parts: log.append(
        ("prefetch", layer_id, pipeline.slots.index(slot), tuple(parts))
    )
    return pipeline, log


def _plan(n=2, pages_used=10):
    return SimpleNamespace(gather_pages_per_rank=n, scratch_pages_used=pages_used)


def _run_layers(pipeline, layers=4, indexer_layers=frozenset({0, 1, 3})):
    used = []
    for layer_id in range(layers):
        if layer_id in indexer_layers:
            slot, prefetched = pipeline.slot_for_store(layer_id, INDEX)
            used.append((layer_id, INDEX, pipeline.slots.index(slot), prefetched))
            pipeline.mark_assembled(layer_id, INDEX)
        slot, prefetched = pipeline.slot_for_store(layer_id, KV)
        used.append((layer_id, KV, pipeline.slots.index(slot), prefetched))
        pipeline.mark_assembled(layer_id, KV)
        assert pipeline.slot_for_read(layer_id, KV) is slot
    return used


class TestPrefetchOrder(CustomTestCase):
    def test_each_layer_prefetches_the_next_after_the_side_stream_waits(self):
        pipeline, log = _pipeline()
        pipeline.begin(_plan(), is_decode=False)
        self.assertTrue(pipeline.prefetching)
        used = _run_layers(pipeline)
        both, kv_only = (KV, INDEX), (KV,)
        self.assertEqual(
            log,
            [
                "side waits", ("load-back", 0), ("prefetch", 0, 0, both),  # at metadata init
                "side waits", ("load-back", 1), ("prefetch", 1, 1, both),  # layer 0's first store
                "side waits", ("load-back", 2), ("prefetch", 2, 0, kv_only),  # layer 2 skips top-k
                "side waits", ("load-back", 3), ("prefetch", 3, 1, both),
            ],
        )
        # Layer l stores into and reads slot l % 2, each part it prefetched.
        self.assertEqual(
            used,
            [
                (0, INDEX, 0, True), (0, KV, 0, True),
                (1, INDEX, 1, True), (1, KV, 1, True),
                (2, KV, 0, True),
                (3, INDEX, 1, True), (3, KV, 1, True),
            ],
        )

    def test_a_slot_reused_by_a_later_layer_refuses_reads_of_the_earlier_one(self):
        pipeline, _ = _pipeline()
        pipeline.begin(_plan(), is_decode=False)
        _run_layers(pipeline)
        pipeline.slot_for_read(3, KV)
        with self.assertRaisesRegex(RuntimeError, "KV of layer 1 read before"):
            pipeline.slot_for_read(1, KV)  # slot 1 now holds layer 3
        with self.assertRaisesRegex(RuntimeError, "indexer K of layer 2"):
            pipeline.slot_for_read(2, INDEX)  # layer 2 stored no indexer K

    def test_indexer_store_of_a_layer_expected_to_skip_is_not_counted_as_prefetched(self):
        pipeline, _ = _pipeline()
        pipeline.begin(_plan(), is_decode=False)
        _run_layers(pipeline, layers=2)
        pipeline.slot_for_store(2, KV)
        slot, prefetched = pipeline.slot_for_store(2, INDEX)
        self.assertFalse(prefetched)  # gathered serially after its store instead

    def test_decode_nothing_to_gather_and_small_slot_run_serially(self):
        for plan, is_decode in ((_plan(), True), (_plan(n=0), False), (_plan(pages_used=101), False)):
            pipeline, log = _pipeline()
            pipeline.begin(plan, is_decode=is_decode)
            self.assertFalse(pipeline.prefetching)
            used = _run_layers(pipeline)
            self.assertEqual(log, [])
            self.assertEqual({u[2] for u in used}, {0})
            self.assertFalse(any(u[3] for u in used))

    def test_a_plan_larger_than_slot_1_is_logged_once(self):
        pipeline, _ = _pipeline()
        with self.assertLogs("sglang_cp_shared_kv.model_executor.peer_page_prefetch", logging.INFO) as logs:
            pipeline.begin(_plan(pages_used=101), is_decode=False)
            pipeline.begin(_plan(pages_used=101), is_decode=False)
        self.assertEqual(len(logs.records), 1)
        self.assertIn("logged once", logs.output[0])

    def test_store_without_its_prefetch_raises(self):
        pipeline, _ = _pipeline()
        pipeline.begin(_plan(), is_decode=False)
        with self.assertRaisesRegex(RuntimeError, "layer 1 stored before its prefetch"):
            pipeline.slot_for_store(1, KV)  # layer 0 never entered: layer 1 not prefetched


if __name__ == "__main__":
    unittest.main()
