"""The bounded waiting room the three joins hold their entries in
(``aggregation.waiting_room``), on a hand-driven clock."""

from __future__ import annotations

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
