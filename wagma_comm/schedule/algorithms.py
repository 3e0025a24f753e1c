"""Collective algorithms, compiled into one Schedule per rank of a group.

``ranks`` is the group (global ranks, in group order); algorithms work on the
positions 0..n-1 in that tuple and address peers by global rank, so any group
(contiguous or a shifting group such as (3, 11, 19, 27)) of any size >= 1 and
any element count >= 0 is accepted.

Every member must finish with bitwise-identical data, and reductions are
commutative but not associative. So each element is reduced by one tree: in
recursive doubling both partners compute ``a op b`` (operands swapped, which
IEEE arithmetic tolerates); in reduce-scatter algorithms (Rabenseifner, ring)
one rank computes a chunk and everyone else receives it. ``avg`` is a sum
followed by one Scale by the group size on the rank that owns the value.

Schedules are cached: the same (rank, group, count, op, algorithm) is compiled
once per process. ``verify.py`` proves each of them.
"""

from __future__ import annotations

from functools import lru_cache, wraps
from typing import Any, Callable, TypeVar

from ..dtypes import OPS
from ..errors import InvalidArgumentError
from .build import ScheduleBuilder, group_index
from .ir import DATA, Schedule, Slot

ALLREDUCE_ALGORITHMS: tuple[str, ...] = ("recursive_doubling", "rabenseifner", "ring", "native")
BROADCAST_ALGORITHMS: tuple[str, ...] = ("binomial", "scatter_allgather", "native")
BARRIER_ALGORITHMS: tuple[str, ...] = ("dissemination",)

ALLREDUCE_CROSSOVER_BYTES = 64 * 1024
"""Buffers of at least this many bytes use "rabenseifner", smaller ones
"recursive_doubling" (latency: log2 n messages of the whole buffer vs.
bandwidth: about 2x the buffer moved in total). 64 KiB is a starting guess,
to be replaced by the crossover measured with ``wagma bench``."""

BROADCAST_CROSSOVER_BYTES = 256 * 1024
"""Buffers of at least this many bytes use "scatter_allgather" (van de Geijn),
smaller ones "binomial". 256 KiB is a starting guess, to be replaced by the
crossover measured with ``wagma bench``."""

_CACHE_SIZE = 1024
"""Compiled schedules kept per process. The caches are typed: untyped, a
call with ``count=1.0`` or ``root=True`` equals (and hashes as) one with
``1`` and would get that call's schedule back without being validated, so a
bad argument would raise or not depending on what was compiled before.
``typed`` types the arguments only, not a tuple's members, and
``(0.0, 1.0) == (False, True) == (0, 1)``: see :func:`_group_cache`."""

_F = TypeVar("_F", bound=Callable[..., Schedule])


_INT_TYPE = frozenset((int,))


def _plain_ints(values: tuple[Any, ...]) -> bool:
    """Every member is an ``int`` itself (not a bool, float or numpy scalar,
    which compare and hash like one). The set of types is built in C: about
    13 ns a member, where a generator took 21."""
    return set(map(type, values)) <= _INT_TYPE


def _group_cache(compile_fn: _F) -> _F:
    """The typed LRU cache in front of a compiler ``f(rank, ranks, ...)``.

    A hit is answered only for a group of plain ints: at once when it is the
    very tuple the schedule was compiled from (``Schedule.ranks``; callers
    reuse their group tuple), else after checking its members. Any other
    group is compiled uncached, so it is validated and refused whatever was
    compiled before (a miss validates too: see ``_check_group``)."""
    cached = lru_cache(maxsize=_CACHE_SIZE, typed=True)(compile_fn)

    @wraps(compile_fn)
    def compile_cached(rank: Any, ranks: Any, *args: Any) -> Schedule:
        if type(ranks) is tuple:
            try:
                sched = cached(rank, ranks, *args)
            except TypeError:  # an unhashable argument: validation names it
                return compile_fn(rank, ranks, *args)
            if sched.ranks is ranks or _plain_ints(ranks):
                return sched
        return compile_fn(rank, ranks, *args)

    compile_cached.cache_info = cached.cache_info  # type: ignore[attr-defined]
    compile_cached.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return compile_cached  # type: ignore[return-value]


# -- choosing ------------------------------------------------------------------
def choose_allreduce(nbytes: int, group_size: int) -> str:
    """The default allreduce algorithm for a buffer of ``nbytes`` bytes."""
    if group_size <= 1 or nbytes < ALLREDUCE_CROSSOVER_BYTES:
        return "recursive_doubling"
    return "rabenseifner"


def choose_broadcast(nbytes: int, group_size: int) -> str:
    """The default broadcast algorithm; with fewer than 3 ranks splitting the
    buffer only adds messages, so binomial is used."""
    if group_size < 3 or nbytes < BROADCAST_CROSSOVER_BYTES:
        return "binomial"
    return "scatter_allgather"


# -- validation ----------------------------------------------------------------
def _check_group(rank: int, ranks: tuple[int, ...], count: int) -> int:
    """Validate the group and return ``rank``'s position in it."""
    if not isinstance(ranks, tuple) or not ranks:
        raise InvalidArgumentError("ranks", f"expected a non-empty tuple, got {ranks!r}")
    try:
        checked, index = _valid_group(ranks)
    except TypeError:  # an unhashable member
        checked, index = (), None
    # _valid_group's cache, like the compile caches, equates (0.0, 1.0) with
    # the (0, 1) it checked; the tuple it checked is all ints.
    if checked is not ranks and not _plain_ints(ranks):
        raise InvalidArgumentError("ranks", f"expected ints >= 0, got {ranks!r}")
    if index is None:
        raise InvalidArgumentError("ranks", f"contains duplicates: {ranks!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in index:
        raise InvalidArgumentError("rank", f"{rank!r} is not a member of {ranks!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise InvalidArgumentError("count", f"expected an int >= 0, got {count!r}")
    return index[rank]


@lru_cache(maxsize=64)
def _valid_group(ranks: tuple[int, ...]) -> tuple[tuple[int, ...], dict[int, int] | None]:
    """The group as checked and the members' positions (None on a
    duplicate); type-checked once per group, since every member's schedule
    is compiled against the same tuple."""
    if not _plain_ints(ranks) or any(r < 0 for r in ranks):
        raise InvalidArgumentError("ranks", f"expected ints >= 0, got {ranks!r}")
    return ranks, group_index(ranks)


def _check_algorithm(algorithm: str, known: tuple[str, ...]) -> None:
    if algorithm not in known:
        raise InvalidArgumentError(
            "algorithm", f"unknown algorithm {algorithm!r}; expected one of {list(known)}")


# -- helpers -------------------------------------------------------------------
@lru_cache(maxsize=256)
def chunk_offsets(count: int, parts: int) -> tuple[int, ...]:
    """``parts + 1`` offsets splitting ``count`` elements as evenly as possible
    (the first ``count % parts`` chunks get one element more)."""
    base, extra = divmod(count, parts)
    out, at = [0], 0
    for i in range(parts):
        at += base + (1 if i < extra else 0)
        out.append(at)
    return tuple(out)


def _span(offsets: tuple[int, ...], first: int, last: int) -> Slot:
    """Chunks ``[first, last)`` of ``data`` as one slot (``last`` clipped)."""
    last = min(last, len(offsets) - 1)
    return Slot(DATA, offsets[first], offsets[last] - offsets[first])


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _base_op(op: str) -> str:
    return "sum" if op == "avg" else op


class _Group:
    """A builder plus the group's geometry, so algorithms read as prose."""

    def __init__(self, b: ScheduleBuilder, me: int) -> None:
        self.b, self.me, self.ranks, self.n = b, me, b.ranks, len(b.ranks)

    def peer(self, pos: int) -> int:
        return self.ranks[pos % self.n]

    def tmp(self, step: int, count: int) -> Slot:
        """A receive buffer; two alternate so the next receive can be posted
        while the previous one is being reduced."""
        return Slot(self.b.scratch(f"tmp{step % 2}", count), 0, count)

    def exchange_reduce(self, mine: Slot, theirs: Slot, pos: int, step: int, op: str) -> None:
        """Send ``theirs`` to ``pos``, receive its copy of ``mine`` and reduce it in.
        An empty chunk still travels, as a zero-byte message (see ``_ring``)."""
        self.b.send(theirs, self.peer(pos))
        tmp = self.tmp(step, mine.count)
        self.b.recv(tmp, self.peer(pos))
        if mine.count:
            self.b.reduce(mine, tmp, op)


# -- allreduce -----------------------------------------------------------------
def _fold_in(g: _Group, p2: int, op: str) -> None:
    """Non-power-of-two groups: position p2+i hands its data to position i."""
    data = Slot(DATA, 0, g.b.count)
    if g.me >= p2:
        g.b.send(data, g.peer(g.me - p2))
    elif g.me + p2 < g.n:
        fold = Slot(g.b.scratch("fold", data.count), 0, data.count)
        g.b.recv(fold, g.peer(g.me + p2))
        g.b.reduce(data, fold, op)


def _fold_out(g: _Group, p2: int) -> None:
    """Return the finished result to the ranks folded in by _fold_in."""
    data = Slot(DATA, 0, g.b.count)
    if g.me >= p2:
        g.b.recv(data, g.peer(g.me - p2))
    elif g.me + p2 < g.n:
        g.b.send(data, g.peer(g.me + p2))


def _recursive_doubling(g: _Group, op: str) -> None:
    p2, red = _pow2_floor(g.n), _base_op(op)
    data = Slot(DATA, 0, g.b.count)
    _fold_in(g, p2, red)
    if g.me < p2:
        mask, step = 1, 0
        while mask < p2:
            g.exchange_reduce(data, data, g.me ^ mask, step, red)
            mask, step = mask << 1, step + 1
        if op == "avg":
            g.b.scale(data, g.n)
    _fold_out(g, p2)


def _rabenseifner(g: _Group, op: str) -> None:
    p2, red = _pow2_floor(g.n), _base_op(op)
    offsets = chunk_offsets(g.b.count, p2)
    _fold_in(g, p2, red)
    if g.me < p2:
        lo, hi = _reduce_scatter_halving(g, p2, offsets, red)
        if op == "avg" and _span(offsets, lo, hi).count:
            g.b.scale(_span(offsets, lo, hi), g.n)
        _allgather_doubling(g, p2, offsets)
    _fold_out(g, p2)


def _reduce_scatter_halving(g: _Group, p2: int, offsets: tuple[int, ...],
                            op: str) -> tuple[int, int]:
    """Recursive halving over chunks; position v ends owning chunk v."""
    lo, hi, mask, step = 0, p2, p2 >> 1, 0
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if g.me & mask else ((lo, mid), (mid, hi))
        g.exchange_reduce(_span(offsets, *keep), _span(offsets, *give), g.me ^ mask, step, op)
        (lo, hi), mask, step = keep, mask >> 1, step + 1
    return lo, hi


def _allgather_doubling(g: _Group, p2: int, offsets: tuple[int, ...]) -> None:
    """Recursive doubling: at distance ``mask`` partners swap aligned blocks."""
    mask = 1
    while mask < p2:
        mine = g.me & ~(mask - 1)
        theirs = mine ^ mask
        partner = g.peer(g.me ^ mask)
        g.b.send(_span(offsets, mine, mine + mask), partner)
        g.b.recv(_span(offsets, theirs, theirs + mask), partner)
        mask <<= 1


def _ring(g: _Group, op: str) -> None:
    """Reduce-scatter ring then allgather ring; position i owns chunk i+1.

    Chunks are empty when the count is below the group size; they still
    travel, as zero-byte messages. Skipping them would shift the message
    numbers of a rank whose count differs (a user error) against its peers',
    so it could match a peer's *next* chunk of the same size and return a
    wrong result silently; sent, every chunk's size is checked on receipt
    (MessageSizeError). The chunked algorithms below do the same."""
    n, me, red = g.n, g.me, _base_op(op)
    offsets = chunk_offsets(g.b.count, n)

    def chunk(c: int) -> Slot:
        return _span(offsets, c % n, c % n + 1)

    for s in range(n - 1):
        g.b.send(chunk(me - s), g.peer(me + 1))
        tmp = g.tmp(s, chunk(me - s - 1).count)
        g.b.recv(tmp, g.peer(me - 1))
        if tmp.count:
            g.b.reduce(chunk(me - s - 1), tmp, red)
    if op == "avg" and chunk(me + 1).count:
        g.b.scale(chunk(me + 1), n)
    for s in range(n - 1):
        g.b.send(chunk(me + 1 - s), g.peer(me + 1))
        g.b.recv(chunk(me - s), g.peer(me - 1))


def _native_allreduce(g: _Group, op: str) -> None:
    """One transport call; avg is lowered to sum + Scale like everywhere else."""
    data = Slot(DATA, 0, g.b.count)
    g.b.native("allreduce", data, _base_op(op), g.ranks)
    if op == "avg":
        g.b.scale(data, g.n)


_ALLREDUCE: dict[str, Callable[[_Group, str], None]] = {
    "recursive_doubling": _recursive_doubling,
    "rabenseifner": _rabenseifner,
    "ring": _ring,
    "native": _native_allreduce,
}


@_group_cache  # typed: see _CACHE_SIZE
def compile_allreduce(rank: int, ranks: tuple[int, ...], count: int, op: str,
                      algorithm: str) -> Schedule:
    """``rank``'s schedule of an in-place allreduce over the group ``ranks``."""
    me = _check_group(rank, ranks, count)
    if op not in OPS:
        raise InvalidArgumentError("op", f"unknown op {op!r}; expected one of {list(OPS)}")
    _check_algorithm(algorithm, ALLREDUCE_ALGORITHMS)
    b = ScheduleBuilder("allreduce", algorithm, rank, ranks, count, op)
    if len(ranks) > 1 and count > 0:
        _ALLREDUCE[algorithm](_Group(b, me), op)
    return b.build()


# -- broadcast -----------------------------------------------------------------
def _binomial(g: _Group, root: int) -> None:
    """Relative position v receives from v - lowbit(v), then sends to v + 2^k."""
    v, data = (g.me - root) % g.n, Slot(DATA, 0, g.b.count)
    mask = 1
    while mask < g.n:
        if v & mask:
            g.b.recv(data, g.peer(root + v - mask))
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if v + mask < g.n:
            g.b.send(data, g.peer(root + v + mask))
        mask >>= 1


def _lowbit_span(v: int, n: int) -> tuple[int, int]:
    """Chunks relative position ``v`` holds after the binomial scatter."""
    if v == 0:
        return 0, n
    return v, min(v + (v & -v), n)


def _scatter_allgather(g: _Group, root: int) -> None:
    """van de Geijn: binomial scatter of n chunks, then a ring allgather that
    skips chunks the receiver already holds (the root receives nothing)."""
    n, v = g.n, (g.me - root) % g.n
    offsets = chunk_offsets(g.b.count, n)
    lo, hi = _lowbit_span(v, n)
    if v:  # empty chunks travel too (see _ring)
        g.b.recv(_span(offsets, lo, hi), g.peer(root + v - (v & -v)))
    mask = _pow2_floor(hi - lo - 1) if hi - lo > 1 else 0  # largest child < hi
    while mask:
        g.b.send(_span(offsets, v + mask, v + 2 * mask), g.peer(root + v + mask))
        mask >>= 1
    _ring_allgather_skip(g, root, offsets)


def _ring_allgather_skip(g: _Group, root: int, offsets: tuple[int, ...]) -> None:
    """Ring allgather in relative positions: at step s position v forwards
    chunk v-s to v+1, unless v+1 got that chunk in the scatter already."""
    n, v = g.n, (g.me - root) % g.n

    def has(u: int, c: int) -> bool:
        lo, hi = _lowbit_span(u % n, n)
        return lo <= c % n < hi

    for s in range(n - 1):
        if not has(v + 1, v - s):
            g.b.send(_span(offsets, (v - s) % n, (v - s) % n + 1), g.peer(root + v + 1))
        if not has(v, v - s - 1):
            g.b.recv(_span(offsets, (v - s - 1) % n, (v - s - 1) % n + 1),
                     g.peer(root + v - 1))


def _native_broadcast(g: _Group, root: int) -> None:
    g.b.native("broadcast", Slot(DATA, 0, g.b.count), "", g.ranks, g.ranks[root])


_BROADCAST: dict[str, Callable[[_Group, int], None]] = {
    "binomial": _binomial,
    "scatter_allgather": _scatter_allgather,
    "native": _native_broadcast,
}


@_group_cache  # typed: see _CACHE_SIZE
def compile_broadcast(rank: int, ranks: tuple[int, ...], count: int, root: int,
                      algorithm: str) -> Schedule:
    """``rank``'s schedule of broadcasting global rank ``root``'s data."""
    me = _check_group(rank, ranks, count)
    if isinstance(root, bool) or not isinstance(root, int) or root not in ranks:
        raise InvalidArgumentError("root", f"{root!r} is not a member of {ranks!r}")
    _check_algorithm(algorithm, BROADCAST_ALGORITHMS)
    b = ScheduleBuilder("broadcast", algorithm, rank, ranks, count, "", root)
    if len(ranks) > 1 and count > 0:
        _BROADCAST[algorithm](_Group(b, me), ranks.index(root))
    return b.build()


# -- barrier -------------------------------------------------------------------
@_group_cache  # typed: see _CACHE_SIZE
def compile_barrier(rank: int, ranks: tuple[int, ...]) -> Schedule:
    """Dissemination barrier: in round k send a zero-byte message to position
    +2^k and receive from -2^k; each send waits for every earlier receive, so
    after ceil(log2 n) rounds every rank has heard (transitively) from all.
    Zero-byte slots carry no hazards, hence the explicit ``after``."""
    me = _check_group(rank, ranks, 0)
    b = ScheduleBuilder("barrier", "dissemination", rank, ranks, 0)
    g, empty, dist = _Group(b, me), Slot(DATA, 0, 0), 1
    received: list[int] = []
    while dist < g.n:
        b.send(empty, g.peer(me + dist), after=received)
        received.append(b.recv(empty, g.peer(me - dist)))
        dist <<= 1
    return b.build()


# -- all-to-all exchange ---------------------------------------------------------
EXCHANGE_SCRATCH = "peers"


@_group_cache  # typed: see _CACHE_SIZE
def compile_exchange(rank: int, ranks: tuple[int, ...], count: int) -> Schedule:
    """Every member sends its ``count`` elements to every other, each received
    into scratch ``"peers"`` at ``position * count``. Not bandwidth-optimal, but
    a missing member is then named directly by whoever waits for it (debug
    fingerprints, the arrival check of a synchronous round)."""
    me = _check_group(rank, ranks, count)
    b = ScheduleBuilder("exchange", "all_to_all", rank, ranks, count)
    peers = b.scratch(EXCHANGE_SCRATCH, count * len(ranks))
    for pos, r in enumerate(ranks):
        if pos != me:
            b.send(Slot(DATA, 0, count), r)
            b.recv(Slot(peers, pos * count, count), r)
    return b.build()


def compile_neighbor_average(rank: int, ranks: tuple[int, ...], count: int,
                             neighbours: tuple[int, ...]) -> Schedule:
    """Gossip averaging (D-PSGD): send the buffer to every rank in
    ``neighbours``, receive theirs into scratch ``"peers"``, and average the
    ``1 + len(neighbours)`` models in place. Every rank must list the ranks it
    exchanges with (symmetric neighbourhoods, e.g. ring neighbours).
    ``neighbours`` is checked before the cache, as ``ranks`` is by it."""
    _check_neighbours(neighbours)
    return _neighbor_average(rank, ranks, count, neighbours)


def _check_neighbours(neighbours: tuple[int, ...]) -> None:
    if type(neighbours) is not tuple or not _plain_ints(neighbours):
        raise InvalidArgumentError(
            "neighbours", f"expected a tuple of int ranks, got {neighbours!r}")


@_group_cache  # typed: see _CACHE_SIZE
def _neighbor_average(rank: int, ranks: tuple[int, ...], count: int,
                      neighbours: tuple[int, ...]) -> Schedule:
    _check_group(rank, ranks, count)
    _check_neighbours(neighbours)
    nbrs = neighbours
    if len(set(nbrs)) != len(nbrs) or any(r == rank or r not in ranks for r in nbrs):
        raise InvalidArgumentError(
            "neighbours", f"expected distinct members of the group other than {rank}, "
            f"got {nbrs!r}")
    b = ScheduleBuilder("allreduce", "neighbor_average", rank, ranks, count, "avg")
    if count == 0 or not nbrs:
        return b.build()
    peers = b.scratch(EXCHANGE_SCRATCH, count * len(nbrs))
    data = Slot(DATA, 0, count)
    for r in nbrs:
        b.send(data, r)
    for k, r in enumerate(nbrs):
        b.recv(Slot(peers, k * count, count), r)
    for k in range(len(nbrs)):
        b.reduce(data, Slot(peers, k * count, count), "sum")
    b.scale(data, 1 + len(nbrs))
    return b.build()


compile_neighbor_average.__wrapped__ = _neighbor_average.__wrapped__  # type: ignore[attr-defined]


# -- whole groups --------------------------------------------------------------
def compile_group(collective: str, ranks: tuple[int, ...] | list[int], count: int = 0,
                  op: str = "", root: int = -1,
                  algorithm: str | None = None) -> tuple[Schedule, ...]:
    """Every member's schedule (group order), e.g. to verify them together.
    ``algorithm=None`` takes the size-based default assuming 4-byte elements."""
    try:
        group = tuple(ranks)
    except TypeError:
        raise InvalidArgumentError("ranks", f"expected a sequence of ranks, got {ranks!r}") \
            from None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        # before the default algorithm is chosen from 4 * count
        raise InvalidArgumentError("count", f"expected an int >= 0, got {count!r}")
    if collective == "allreduce":
        name = algorithm or choose_allreduce(4 * count, len(group))
        return tuple(compile_allreduce(r, group, count, op, name) for r in group)
    if collective == "broadcast":
        name = algorithm or choose_broadcast(4 * count, len(group))
        return tuple(compile_broadcast(r, group, count, root, name) for r in group)
    if collective == "barrier":
        _check_algorithm(algorithm or "dissemination", BARRIER_ALGORITHMS)
        return tuple(compile_barrier(r, group) for r in group)
    raise InvalidArgumentError(
        "collective", f"unknown collective {collective!r}; expected allreduce, "
        "broadcast or barrier")
