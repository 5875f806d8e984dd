"""The silence rule's clock (pushkv/net/silence.py), on a clock the test moves:
when a stream is overdue, and when a client with several replicas asks
another which one leads. The processes that live by it are in tests/test_ha.py
(frozen leaders, frozen replicas first in a list)."""

from __future__ import annotations

from pushkv.net.silence import UNANSWERED_LIMITS, SilenceWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def asks_until(watch: SilenceWatch, clock: Clock, end: float, step: float = 0.125) -> list[float]:
    """The silences at which the watchdog, looking each `step` (exact in binary,
    so the sums are too), asks."""
    asked = []
    start = clock.now
    while clock.now - start < end:
        clock.now += step
        if watch.ask_due():
            asked.append(watch.silent_for())
    return asked


def test_an_answered_stream_asks_after_two_intervals_then_each_interval() -> None:
    clock = Clock()
    watch = SilenceWatch(clock=clock)
    watch.heard()  # the welcome
    watch.told(lease_ms=5000, heartbeat_interval_ms=1000)
    assert asks_until(watch, clock, 4.8) == [2.0, 3.0, 4.0]
    assert not watch.overdue()  # 4.875 s
    clock.now += 0.25
    assert watch.overdue()  # the lease is still the limit
    watch.heard()  # an answer starts the count again
    assert asks_until(watch, clock, 2.55) == [2.0]


def test_an_unanswered_stream_asks_after_each_limit() -> None:
    clock = Clock()
    watch = SilenceWatch(limit_s=5.0, clock=clock)
    watch.started()
    assert asks_until(watch, clock, 19.8) == [5.0, 10.0, 15.0]
    assert not watch.overdue()  # 19.875 s
    clock.now += UNANSWERED_LIMITS * 5.0 - 19.875 + 0.125
    assert watch.overdue()
    watch.started()  # a new stream: not answered either
    assert asks_until(watch, clock, 5.05) == [5.0]
