"""Where the monitor's messages come from: the fleet's publishers live (the capture's own
FleetCapture, replays and restarts included), or a capture file replayed at a chosen speed (the
Live page's demo, the benchmarks). Both hand each decoded message to a MonitorState."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ..capture.capture_file import CaptureReader
from ..capture.events import decode_batch
from ..capture.zmq_capture import Endpoint, FleetCapture, ReplicaState
from ..errors import CaptureError
from .state import MonitorState

Say = Callable[[str], None]


def run_live(state: MonitorState, sources: list[Endpoint], topic: str = "", say: Say = lambda s: None,
             duration: float | None = None, should_stop: Callable[[], bool] = lambda: False,
             progress: Callable[[dict[str, ReplicaState]], None] = lambda s: None, every: float = 10.0) -> None:
    """Subscribe to the publishers until the duration passes or should_stop(); a bad address is an
    EndpointError before anything starts, every other trouble is said and counted."""
    fleet = FleetCapture(sources, topic=topic, say=say)
    state.streams = fleet.states
    said = [time.monotonic()]

    def tick(states: dict[str, ReplicaState]) -> None:
        state.tick(states)
        if time.monotonic() - said[0] >= every:
            said[0] = time.monotonic()
            progress(states)

    try:
        fleet.run(state, duration=duration, should_stop=should_stop, progress=tick, every=min(state.fold_s, 0.5))
    finally:
        fleet.close()
        _disconnected(fleet.states)
        state.flush()


def run_replay(state: MonitorState, path: str | Path, speed: float = 0.0, say: Say = lambda s: None,
               should_stop: Callable[[], bool] = lambda: False,
               progress: Callable[[dict[str, ReplicaState]], None] = lambda s: None, every: float = 10.0) -> int:
    """Feed a JSONL capture's messages in order, `speed` times as fast as the publishers' clocks went
    (0: as fast as it can). Sequence numbers are followed as the live capture follows them; a message
    that does not decode is counted and said. Returns the messages fed."""
    reader = CaptureReader(path)
    states: dict[str, ReplicaState] = {}
    state.streams = states
    start_ts = start = None
    fed, said = 0, time.monotonic()
    for where, m in reader:
        if should_stop():
            break
        st = states.get(m.replica)
        if st is None:
            st = states[m.replica] = ReplicaState(Endpoint(m.replica, str(path)), connected=True)
        if m.restart != st.restarts:
            st.restarts, st.last, st.gaps = m.restart, None, []
        if st.last is None or m.seq > st.last:
            st.advance(m.seq)
        try:
            batch = decode_batch(m.payload, where)
            if speed > 0:
                start_ts = batch.ts if start_ts is None else start_ts
                start = time.monotonic() if start is None else start
                if (wait := (batch.ts - start_ts) / speed - (time.monotonic() - start)) > 0:
                    time.sleep(wait)
            state.add(m, batch)
        except CaptureError as e:
            st.invalid += 1
            say(f"{e}; left out")
        else:
            st.count += 1
            fed += 1
        state.tick(states)
        if time.monotonic() - said >= every:
            said = time.monotonic()
            progress(states)
    _disconnected(states)
    state.flush()
    return fed


def _disconnected(states: dict[str, ReplicaState]) -> None:
    """The feed has ended: no replica is followed any more."""
    for st in states.values():
        st.connected = False
