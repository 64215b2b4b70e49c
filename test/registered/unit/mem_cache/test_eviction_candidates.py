"""EvictionCandidates pops what a heap rebuilt from the set would pop, under priorities that grow
(LRU-like, never touched), that shrink (MRU-like, touched), removals and compaction."""

import random
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.eviction_candidates import EvictionCandidates

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


class _Node:
    def __init__(self, node_id: int, priority: float):
        self.id, self.priority = node_id, priority


def _brute_force_min(members):
    return min(members, key=lambda n: (n.priority, n.id)) if members else None


class TestEvictionCandidates(CustomTestCase):
    def _run(self, seed: int, decreasing: bool):
        rng = random.Random(seed)
        candidates = EvictionCandidates(lambda n: n.priority)
        nodes = [_Node(i, rng.randint(0, 50)) for i in range(300)]
        popped = 0
        for _ in range(6000):
            node = rng.choice(nodes)
            action = rng.random()
            if action < 0.35:
                pushes = node not in candidates
                candidates.add(node)
                # Stale entries are bounded after every push (compaction).
                if pushes:
                    self.assertLessEqual(len(candidates._heap), 2 * len(candidates) + candidates.COMPACT_SLACK)
            elif action < 0.5:
                candidates.discard(node)
            elif action < 0.8:
                # An access: the priority grows, or (MRU) shrinks and the cache touches the node.
                if decreasing:
                    node.priority -= rng.randint(0, 5)
                    candidates.touch(node)
                else:
                    node.priority += rng.randint(0, 5)
            else:
                expected = _brute_force_min(set(candidates))
                top = candidates.peek()
                self.assertIs(top[3] if top else None, expected)
                if expected is not None and rng.random() < 0.5:
                    self.assertIs(candidates.pop_top(), expected)
                    candidates.discard(expected)
                    popped += 1
        self.assertGreater(popped, 100)

    def test_growing_priorities_without_touch(self):
        for seed in range(3):
            self._run(seed, decreasing=False)

    def test_shrinking_priorities_with_touch(self):
        for seed in range(3):
            self._run(seed, decreasing=True)

    def test_set_behaviour_for_stock_code(self):
        candidates = EvictionCandidates(lambda n: n.priority)
        a, b = _Node(1, 5), _Node(2, 5)
        candidates.add(a)
        candidates.add(a)
        candidates.add(b)
        self.assertEqual(candidates, {a, b})
        candidates.remove(a)
        self.assertIs(candidates.peek()[3], b)  # a's entry is dropped, ties go by id
        candidates.clear()
        self.assertIsNone(candidates.peek())
        self.assertEqual(len(candidates._heap), 0)


if __name__ == "__main__":
    unittest.main()
