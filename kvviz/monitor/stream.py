"""Per replica, what the stream itself says, apart from its events: messages, decoding failures,
publisher restarts, lost messages and how late events arrive. Sequence numbers and gaps are the
capture's own bookkeeping (capture/zmq_capture.py's ReplicaState); this turns them into counts that
only go up, as Prometheus counters must."""

from __future__ import annotations

from dataclasses import dataclass

from ..capture.zmq_capture import ReplicaState


@dataclass
class Lag:
    """Seconds from a batch's publisher timestamp to its arrival here (clock skew included)."""
    count: int = 0
    total: float = 0.0
    last: float | None = None

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.last = seconds


@dataclass
class Losses:
    """Messages lost for good: missing sequence numbers once no replay is pending to fill them,
    summed over the publisher's lives (a restart ends a life and asks for a replay of the new one).
    Never decreases: a message that arrives after being counted lost stays counted."""
    counted: int = 0  # exposed
    earlier_lives: int = 0  # lost in the publisher's lives before this one
    this_life: int = 0  # the current life's missing, as last seen with no replay pending
    restarts: int = 0

    def update(self, st: ReplicaState) -> None:
        if st.restarts != self.restarts:
            self.earlier_lives += self.this_life
            self.this_life, self.restarts = 0, st.restarts
        if st.replaying is None:
            self.this_life = st.lost
        self.counted = max(self.counted, self.earlier_lives + self.this_life)
