"""The bounded waiting room the three joins hold their entries in
(``aggregation.waiting_room``), on a hand-driven clock."""

from __future__ import annotations

import random

import pytest

from phasewatch.aggregation.waiting_room import CAPACITY, EXPIRED, Leaving, Room


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_an_entry_waits_its_hold_then_a_sweep_hands_it_over_as_expired(clock):
    room = Room(hold=10.0, max_size=5, clock=clock)
    room.put("a", 1)
    clock.t += 9.9
    assert room.sweep() == [] and len(room) == 1 and "a" in room
    clock.t += 0.1  # the deadline itself is due
    assert room.sweep() == [Leaving("a", 1, EXPIRED)]
    assert len(room) == 0 and room.get("a") is None


def test_take_removes_a_complete_entry_and_it_is_never_swept(clock):
    room = Room(hold=1.0, max_size=5, clock=clock)
    assert room.put("a", [1]) == [1]
    room.get("a").append(2)
    assert room.take("a") == [1, 2]
    clock.t += 5
    assert room.sweep() == []
    with pytest.raises(KeyError):
        room.take("a")


def test_a_key_waits_once(clock):
    room = Room(hold=1.0, max_size=5, clock=clock)
    room.put("a", 1)
    with pytest.raises(ValueError, match="already waiting"):
        room.put("a", 2)


def test_put_takes_the_callers_time(clock):
    room = Room(hold=2.0, max_size=5, clock=clock)
    room.put("a", 1, now=50.0)  # the join's own reading of the clock
    assert room.sweep(now=51.9) == [] and room.sweep(now=52.0) == [Leaving("a", 1, EXPIRED)]


def test_sweep_hands_over_the_expired_oldest_first_then_the_oldest_past_capacity(clock):
    room = Room(hold=10.0, max_size=2, clock=clock)
    for i, key in enumerate("abcde"):
        clock.t = 100.0 + i
        room.put(key, i)  # five in a room of two: put evicts nothing
    assert len(room) == 5
    clock.t = 111.0  # a and b are due; of c, d, e one is past capacity
    assert room.sweep() == [Leaving("a", 0, EXPIRED), Leaving("b", 1, EXPIRED),
                            Leaving("c", 2, CAPACITY)]
    assert list(room.values()) == [3, 4]


def test_sweep_at_infinity_hands_over_everything_as_expired(clock):
    room = Room(hold=10.0, max_size=1, clock=clock)
    room.put("a", 0)
    room.put("b", 1)
    assert room.sweep(float("inf")) == [Leaving("a", 0, EXPIRED), Leaving("b", 1, EXPIRED)]


def test_make_room_evicts_the_oldest_so_one_more_fits(clock):
    room = Room(hold=10.0, max_size=2, clock=clock)
    assert room.make_room() == []
    room.put("a", 0)
    room.put("b", 1)
    assert room.make_room() == [Leaving("a", 0, CAPACITY)]
    room.put("c", 2)
    assert list(room.values()) == [1, 2]


def test_a_moved_deadline_is_kept_and_the_eviction_order_is_not(clock):
    """The stream join moves a finished request's deadline (``ttl`` -> ``grace``): a
    sweep then finds it wherever it is, and the oldest is still evicted first."""
    room = Room(hold=600.0, max_size=3, clock=clock)
    room.put("a", 0)
    room.put("b", 1)
    room.hold_until("b", clock.t + 5.0)
    clock.t += 5.0
    assert room.sweep() == [Leaving("b", 1, EXPIRED)]
    room.put("c", 2)
    room.put("d", 3)
    assert room.make_room() == [Leaving("a", 0, CAPACITY)]
    room.hold_until("d", clock.t + 1000.0)  # later than its hold: it waits longer
    clock.t += 600.0
    assert room.sweep() == [Leaving("c", 2, EXPIRED)] and list(room.values()) == [3]


def test_max_size_can_be_lowered_and_the_next_sweep_keeps_it(clock):
    room = Room(hold=10.0, max_size=5, clock=clock)
    for key in "abc":
        room.put(key, key)
    room.max_size = 1
    assert [x.reason for x in room.sweep()] == [CAPACITY, CAPACITY] and len(room) == 1


class CountedKey(str):
    """A key that counts how often the room looks it up (hashes it)."""

    looked_up = 0

    def __hash__(self) -> int:
        CountedKey.looked_up += 1
        return str.__hash__(self)


def test_after_a_moved_deadline_a_sweep_looks_only_at_the_due_entries(clock):
    """One out-of-order deadline (the stream join moves every finished request's) must
    not turn every later sweep into a look at every entry: a sweep with nothing due
    looks up no entry, one with a single entry due about one, however full the room."""
    room = Room(hold=600.0, max_size=10_000, clock=clock)
    keys = [CountedKey(f"k{i}") for i in range(2000)]
    for key in keys:
        room.put(key, key)
    room.hold_until(keys[1000], clock.t + 5.0)  # out of the entries' order
    CountedKey.looked_up = 0
    for _ in range(10):
        clock.t += 0.1
        assert room.sweep() == []
    assert CountedKey.looked_up == 0
    clock.t += 5.0
    assert room.sweep() == [Leaving(keys[1000], keys[1000], EXPIRED)]
    assert CountedKey.looked_up <= 5
    CountedKey.looked_up = 0
    clock.t += 1.0
    assert room.sweep() == [] and CountedKey.looked_up == 0
    assert len(room) == 1999


def test_a_room_with_moved_deadlines_sweeps_as_a_full_scan_would(clock):
    """The room against the plain rule (every entry due, oldest first, then the oldest
    past capacity) over puts, takes, moves and sweeps drawn at random."""
    rng = random.Random(7)
    room = Room(hold=10.0, max_size=40, clock=clock)
    model: dict[str, float] = {}  # key -> deadline, in the order they came
    n = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            key = f"k{n}"
            n += 1
            room.put(key, key)
            model[key] = clock.t + 10.0
        elif op < 0.6 and model:
            key = rng.choice(list(model))
            assert room.take(key) == key
            del model[key]
        elif op < 0.8 and model:
            key = rng.choice(list(model))
            deadline = clock.t + rng.choice((0.0, 1.0, 3.0, 30.0, 10.0))
            room.hold_until(key, deadline)
            model[key] = deadline
        else:
            clock.t += rng.choice((0.5, 1.0, 2.0))
            due = [k for k, d in model.items() if d <= clock.t]
            for k in due:
                del model[k]
            over = list(model)[:max(len(model) - 40, 0)]
            for k in over:
                del model[k]
            assert room.sweep() == ([Leaving(k, k, EXPIRED) for k in due]
                                    + [Leaving(k, k, CAPACITY) for k in over])
        assert len(room) == len(model) and list(room.values()) == list(model)


def test_what_a_moved_entry_leaves_behind_does_not_pile_up(clock):
    """The stream join's usual case: a request's deadline is moved when it finishes,
    then it is taken out (or moved again) long before that deadline. What it leaves
    behind is dropped, so a busy room's memory follows its entries."""
    room = Room(hold=3600.0, max_size=10, clock=clock)
    for i in range(20_000):
        room.put(str(i), i)
        room.hold_until(str(i), clock.t + 600.0)
        room.hold_until(str(i), clock.t + 300.0)
        if i % 2:
            room.take(str(i))
        else:
            room.make_room()
    assert len(room) <= 10 and len(room._heap) < 100
