"""Token routing and activator choice of external triggering (pure rules)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from wagma_comm.runtime import activation


def _simulate(n: int, activators: list[int], rng: random.Random) -> tuple[set[int], Counter]:
    """Deliver tokens in a random order; return who was activated and how many
    tokens each member sent."""
    threshold = {i: activation.no_tokens_sent(n) for i in range(n)}
    activated: set[int] = set()
    sent: Counter = Counter()
    in_flight: list[tuple[int, int]] = []  # (sender, receiver)

    def send_from(me: int, came: int) -> None:
        targets, threshold[me] = activation.forward(me, n, came, threshold[me])
        for t in targets:
            in_flight.append((me, t))
            sent[me] += 1

    pending_roots = list(activators)
    while pending_roots or in_flight:
        if pending_roots and (not in_flight or rng.random() < 0.3):
            root = pending_roots.pop()
            activated.add(root)
            send_from(root, -1)
            continue
        sender, receiver = in_flight.pop(rng.randrange(len(in_flight)))
        activated.add(receiver)
        send_from(receiver, activation.incoming_dimension(receiver, sender, n))
    return activated, sent


@pytest.mark.parametrize("n", list(range(1, 34)) + [64, 100])
def test_every_member_is_reached_whatever_the_order_and_activators(n: int) -> None:
    rng = random.Random(n)
    dims = activation.dimensions(n)
    for trial in range(30):
        k = 1 + trial % min(n, 5)
        roots = rng.sample(range(n), k)
        activated, sent = _simulate(n, roots, rng)
        assert activated == set(range(n)), (n, roots)
        assert all(c <= dims for c in sent.values())


@pytest.mark.parametrize("k", range(0, 8))
def test_one_activator_on_a_hypercube_sends_n_minus_1_tokens(k: int) -> None:
    n = 1 << k
    activated, sent = _simulate(n, [random.Random(k).randrange(n)], random.Random(1))
    assert activated == set(range(n))
    assert sum(sent.values()) == n - 1


def test_power_of_two_tree_is_the_xor_hypercube_tree_from_zero() -> None:
    # From member 0 the reference's XOR tree and ours coincide: 0 -> 1, 2, 4, ...
    targets, thr = activation.forward(0, 8, -1, activation.no_tokens_sent(8))
    assert targets == [1, 2, 4] and thr == -1
    # member 2 got it along dimension 1, forwards along dimension 2 only
    assert activation.forward(2, 8, 1, activation.no_tokens_sent(8))[0] == [6]
    # a later token along dimension 0 adds dimension 1, not 2 again
    assert activation.forward(2, 8, 0, 1)[0] == [4]


def test_incoming_dimension_rejects_non_neighbours() -> None:
    assert activation.incoming_dimension(5, 1, 8) == 2
    with pytest.raises(ValueError):
        activation.incoming_dimension(3, 0, 8)


def test_majority_activator_is_deterministic_and_spread() -> None:
    seq = [activation.majority_activator(7, r, 8) for r in range(4000)]
    assert seq == [activation.majority_activator(7, r, 8) for r in range(4000)]
    assert seq != [activation.majority_activator(8, r, 8) for r in range(4000)]
    counts = Counter(seq)
    assert set(counts) == set(range(8))
    assert all(abs(c - 500) < 100 for c in counts.values())


def test_sync_rounds_and_group_steps() -> None:
    assert [r for r in range(30) if activation.is_sync_round(r, 10)] == [9, 19, 29]
    steps = [activation.group_step(r, 4) for r in range(12)
             if not activation.is_sync_round(r, 4)]
    assert steps == list(range(9))  # no group step is skipped by a sync round
    assert all(activation.is_sync_round(r, 1) for r in range(5))


@pytest.mark.parametrize("n", range(1, activation.FLAT_MAX + 1))
def test_flat_activation_tells_every_other_member_once(n: int) -> None:
    for me in range(n):
        targets = activation.flat_targets(me, n)
        assert sorted(targets) == [m for m in range(n) if m != me]
        assert targets == sorted(targets, key=lambda m: (m - me) % n)  # nearest first
