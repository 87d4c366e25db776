"""The prefetch queue (utility levels, FIFO per level) and the eviction pool (§3.4)."""

from moespec.offload.policies.queues import EvictionPool, PrefetchQueue


def test_prefetches_leave_by_utility_then_in_the_order_they_came():
    q = PrefetchQueue(num_layers=3, num_experts=4, max_utility=4)
    for layer, expert, level in [(0, 1, 2), (1, 0, 4), (2, 3, 2), (0, 2, 4)]:
        q.push(layer, expert, level)
    assert [q.pop() for _ in range(5)] == [(1, 0), (0, 2), (0, 1), (2, 3), None]


def test_cancelling_a_layer_drops_only_its_requests():
    q = PrefetchQueue(2, 4, 4)
    q.push(0, 1, 3)
    q.push(1, 2, 3)
    q.push(0, 3, 1)
    assert q.cancel_layer(0) == 2
    assert [q.pop(), q.pop()] == [(1, 2), None]


def test_a_request_pushed_again_at_another_level_leaves_once_at_the_new_level():
    q = PrefetchQueue(1, 4, 4)
    q.push(0, 1, 1)
    q.push(0, 2, 2)
    q.push(0, 1, 3)
    assert [q.pop(), q.pop(), q.pop()] == [(0, 1), (0, 2), None]


def test_the_victim_is_the_least_recently_used_of_the_lowest_utility_that_can_leave():
    pool = EvictionPool(2, 4, 4, expert_bytes=[10, 10])
    for key, level in [((0, 0), 1), ((0, 1), 0), ((1, 2), 0), ((1, 3), 2)]:
        pool.add(*key, level)
    pool.move(0, 1, 0)  # (0, 1) used: now after (1, 2) in level 0
    assert pool.victim(below=4, can_leave=lambda layer, e: True) == (1, 2)
    assert pool.victim(below=4, can_leave=lambda layer, e: (layer, e) != (1, 2)) == (0, 1)
    assert pool.victim(below=1, can_leave=lambda layer, e: layer == 0 and e == 0) is None
    assert pool.bytes_at.tolist() == [20, 10, 10, 0, 0]


def test_pushing_many_is_pushing_each_in_order():
    one, many = PrefetchQueue(2, 6, 3), PrefetchQueue(2, 6, 3)
    requests = [(1, 5, 2), (1, 0, 3), (1, 5, 2), (1, 2, 1), (1, 5, 3)]
    one.push(0, 4, 3)
    many.push(0, 4, 3)
    for layer, expert, level in requests:
        one.push(layer, expert, level)
    many.push_many(1, [e for _, e, _ in requests], [lv for _, _, lv in requests])
    assert [one.pop() for _ in range(6)] == [many.pop() for _ in range(6)]
    assert len(one) == len(many) == 0


def test_moving_many_is_moving_each_in_order_and_keeps_the_bytes_per_level():
    one = EvictionPool(2, 4, 3, expert_bytes=[10, 30])
    many = EvictionPool(2, 4, 3, expert_bytes=[10, 30])
    for pool in (one, many):
        for key, level in [((0, 0), 1), ((1, 1), 0), ((1, 2), 2), ((1, 3), 0)]:
            pool.add(*key, level)
    moves = [(3, 2), (1, 0), (2, 2), (3, 1)]  # layer 1: (expert, new level)
    for expert, level in moves:
        one.move(1, expert, level)
    many.move_many(1, [e for e, _ in moves], [lv for _, lv in moves])
    assert one.buckets == many.buckets
    assert many.bytes_at.tolist() == [30, 40, 30, 0]  # level 0: (1, 1); 1: (0, 0), (1, 3)
    assert many.bytes_below() == [30, 70, 100]  # levels < tau for tau = 1, 2, 3
    assert [list(b) for b in many.buckets] == [[(1, 1)], [(0, 0), (1, 3)], [(1, 2)], []]
