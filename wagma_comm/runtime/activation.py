"""Rules of external triggering: who activates a round and where tokens go.

A partial collective's round is *activated* by the first rank that arrives at
it (solo, WAGMA) or by one agreed rank (majority). The activation travels as
small tokens between progress threads, so a rank whose application thread is
still computing joins the round at once. Everything here is pure arithmetic,
identical on every rank; the service in ``partial/`` does the messaging.

Token routing (ALGORITHMS.md section 3): the reference broadcasts over a
hypercube, one token per dimension, a receiver forwarding along higher
dimensions only -- a binomial tree rooted at the activator. Two rules make it
work for any number of members ``n`` and for several activators at once:

* dimension ``d`` of member ``i`` (an index into the round's member list) is the
  member ``(i + 2**d) mod n``; with ``n`` a power of two and one activator this
  is exactly the reference's XOR hypercube tree (``n - 1`` tokens);
* a member keeps a threshold ``t`` ("I have sent along every dimension > t"). Its
  own activation sends along every dimension (``t = -1``); a token that came in
  along dimension ``d`` makes it send along the dimensions in ``(d, t]`` it has
  not covered yet. So whatever the order tokens arrive in, every member sends
  along every dimension above each one it received from, and each activator's
  binomial tree is covered: every member is reached. A member sends at most
  ``ceil(log2 n)`` tokens per round.

A per-group activation (WAGMA's ``activation="group"``) over at most
``FLAT_MAX`` members is flat instead: the activator sends a token to every
other member and receivers forward nothing. A small group's round waits for
its last member to learn of it, and on a loaded host every hop costs a
scheduler wake-up: one hop beats ``ceil(log2 n)`` (docs/partial.md).
"""

from __future__ import annotations

from .._splitmix import splitmix64


FLAT_MAX = 16  # largest per-group scope activated by a flat broadcast


def flat_targets(me: int, n: int) -> list[int]:
    """Whom a flat activation by member ``me`` of ``n`` tells: everyone else."""
    return [(me + k) % n for k in range(1, n)]


def dimensions(n: int) -> int:
    """Hypercube dimensions for ``n`` members: ``ceil(log2 n)``."""
    return max(0, (n - 1).bit_length())


def no_tokens_sent(n: int) -> int:
    """The threshold of a member that has sent nothing yet."""
    return dimensions(n) - 1


def incoming_dimension(me: int, sender: int, n: int) -> int:
    """The dimension a token from member ``sender`` arrived along."""
    gap = (me - sender) % n
    if gap == 0 or gap & (gap - 1):
        raise ValueError(f"member {sender} is not a hypercube neighbour of {me} (n={n})")
    return gap.bit_length() - 1


def forward(me: int, n: int, came_along: int, threshold: int) -> tuple[list[int], int]:
    """Members to send a token to, and the new threshold.

    ``came_along``: the dimension the activation came in on, or -1 for this
    member's own activation. ``threshold``: its current threshold.
    """
    dims = range(came_along + 1, threshold + 1)
    targets = [(me + (1 << d)) % n for d in dims]
    return targets, min(threshold, came_along)


def majority_activator(seed: int, round: int, size: int) -> int:
    """The rank that activates ``round`` of a majority allreduce: a hash of
    (seed, round), so every rank agrees without communicating."""
    return splitmix64((seed * 0x9E3779B97F4A7C15 + round) & 0xFFFFFFFFFFFFFFFF) % size


def is_sync_round(round: int, sync_every: int) -> bool:
    """Every ``sync_every``-th iteration (rounds sync_every-1, 2*sync_every-1, ...)
    is a blocking global round; counted in iterations, not per object."""
    return (round + 1) % sync_every == 0


def group_step(round: int, sync_every: int) -> int:
    """The shifting-group step of a (non-sync) round: the number of group rounds
    before it, so sync rounds do not skip group steps."""
    return round - (round + 1) // sync_every
