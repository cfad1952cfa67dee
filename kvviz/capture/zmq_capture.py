"""Subscribe to the KV-event publishers of a fleet (vLLM or SGLang replicas) over ZMQ, in one process.

Messages are three frames: topic, an 8-byte big-endian sequence number, the msgpack payload. With a
replay endpoint, the buffered history is asked for first, and again after the publisher restarts
(its sequence numbers go back). Both publishers' ROUTER expects a REQ-style request (an empty
delimiter frame, then the start sequence number as 8 bytes) and answers each buffered batch with an
empty delimiter and then (topic, seq, payload) from vLLM 0.33 or (seq, payload) from SGLang and
older vLLM, ending with seq -1 in the same place.

Per replica the capture counts messages, restarts, gaps (sequence numbers never received, shrunk
when a replay fills them) and messages that are not KV-event batches (wrong frames or payloads:
reported, not written). A publisher that cannot be reached is reported and the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from .capture_file import Message
from .events import Batch, CaptureError, decode_batch

SUB_HWM = 200_000  # messages queued per publisher while the capture is busy (a replay, a Parquet flush)
REPLAY_WAIT_S = 2.0
UNREACHABLE_AFTER_S = 3.0


class EndpointError(CaptureError):
    """An endpoint ZMQ cannot connect to (a malformed address): said before anything is written."""


class Sink(Protocol):
    def add(self, m: Message, batch: Batch) -> None: ...


@dataclass(frozen=True)
class Endpoint:
    name: str
    endpoint: str
    replay: str | None = None


@dataclass
class ReplicaState:
    """What the capture knows of one replica, for progress lines and the final report."""
    source: Endpoint
    count: int = 0
    last: int | None = None  # the highest sequence number of the current publisher run
    restarts: int = 0
    gaps: list[list[int]] = field(default_factory=list)  # [first, last] sequence numbers never received
    invalid: int = 0
    connected: bool = False
    replaying: float | None = None  # when the pending replay request was sent
    replayed: set[int] = field(default_factory=set)  # seqs a replay wrote that may still arrive live

    @property
    def lost(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.gaps)

    def missing(self, seq: int) -> bool:
        return any(lo <= seq <= hi for lo, hi in self.gaps)

    def advance(self, seq: int) -> None:
        """A sequence number past the last: what it skipped is a gap."""
        if self.last is not None and seq > self.last + 1:
            self.gaps.append([self.last + 1, seq - 1])
        self.last = seq

    def fill(self, seq: int) -> None:
        """A replayed message: its sequence number is no longer missing."""
        for i, (lo, hi) in enumerate(self.gaps):
            if lo <= seq <= hi:
                self.gaps[i:i + 1] = [g for g in ([lo, seq - 1], [seq + 1, hi]) if g[0] <= g[1]]
                return


def open_socket(ctx: zmq.Context, kind: int, endpoint: str, flag: str, bind: bool = False) -> zmq.Socket:
    """A socket connected (or bound) to the endpoint; a malformed one is an EndpointError naming the flag."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(endpoint) if bind else sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close()
        raise EndpointError(f"{flag} {endpoint!r}: {e} (expected e.g. tcp://{'*' if bind else 'host'}:5557)") from None
    return sock


Say = Callable[[str], None]


class FleetCapture:
    """One SUB socket (and optionally one replay DEALER) per replica, polled together."""

    def __init__(self, sources: list[Endpoint], topic: str = "", say: Say = lambda s: None):
        self.say = say
        self.ctx = zmq.Context()
        self.states = {s.name: ReplicaState(s) for s in sources}
        self.sub: dict[zmq.Socket, ReplicaState] = {}
        self.replay: dict[zmq.Socket, ReplicaState] = {}
        self.monitor: dict[zmq.Socket, ReplicaState] = {}
        self.replay_of: dict[str, zmq.Socket] = {}
        try:
            for s in sources:
                sub = open_socket(self.ctx, zmq.SUB, s.endpoint, "--endpoint")
                sub.setsockopt(zmq.RCVHWM, SUB_HWM)
                sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
                self.sub[sub] = self.states[s.name]
                self.monitor[sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)] = self.states[
                    s.name]
                if s.replay:
                    dealer = open_socket(self.ctx, zmq.DEALER, s.replay, "--replay")
                    self.replay[dealer], self.replay_of[s.name] = self.states[s.name], dealer
        except BaseException:
            self.close()
            raise
        self.poller = zmq.Poller()
        for sock in (*self.sub, *self.replay, *self.monitor):
            self.poller.register(sock, zmq.POLLIN)

    def run(self, sink: Sink, duration: float | None = None, should_stop: Callable[[], bool] = lambda: False,
            progress: Callable[[dict[str, ReplicaState]], None] = lambda s: None, every: float = 0.5) -> None:
        """Capture into the sink until the duration passes or should_stop(); replays are asked for first.
        The history each replay returns is written before live messages (which wait in the SUB queue)."""
        self.sink = sink
        started = time.monotonic()
        for name in self.replay_of:
            self._ask_replay(self.states[name], 0)
        self._finish_replays(started)
        end = None if duration is None else started + duration
        said_unreachable: set[str] = set()
        next_progress = time.monotonic()
        while not should_stop() and (end is None or time.monotonic() < end):
            for sock, _ in self.poller.poll(100):
                if sock in self.sub:
                    self._drain(sock, self.sub[sock])
                elif sock in self.replay:
                    self._replay_answer(sock, self.replay[sock])
                else:
                    self._monitor_event(sock, self.monitor[sock])
            now = time.monotonic()
            for st in self.states.values():
                if st.replaying is not None and now - st.replaying > REPLAY_WAIT_S:
                    st.replaying = None  # no answer: the publisher keeps no history
                if not st.connected and now - started > UNREACHABLE_AFTER_S and st.source.name not in said_unreachable:
                    said_unreachable.add(st.source.name)
                    others = ", and capturing the others" if len(self.states) > 1 else ""
                    self.say(f"{st.source.name}: cannot reach {st.source.endpoint} yet; still trying{others}")
            if now >= next_progress:
                progress(self.states)
                next_progress = now + every

    def _finish_replays(self, started: float) -> None:
        while any(st.replaying is not None for st in self.states.values()):
            if time.monotonic() - started > REPLAY_WAIT_S:
                for st in self.states.values():
                    st.replaying = None
                return
            for sock, _ in self.poller.poll(50):
                if sock in self.replay:
                    self._replay_answer(sock, self.replay[sock])
                elif sock in self.monitor:
                    self._monitor_event(sock, self.monitor[sock])

    def _ask_replay(self, st: ReplicaState, start: int) -> None:
        self.replay_of[st.source.name].send_multipart([b"", start.to_bytes(8, "big")])  # the REQ delimiter
        st.replaying = time.monotonic()

    def _replay_answer(self, sock: zmq.Socket, st: ReplicaState) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)  # [b"", topic, seq, payload] or [b"", seq, payload]
            except zmq.Again:
                return
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                continue
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                st.replaying = None
                continue
            if st.last is not None and seq <= st.last and not st.missing(seq):
                continue  # already written
            st.fill(seq)
            self._write(st, seq, frames[1] if len(frames) == 4 else b"", frames[-1])
            st.replayed.add(seq)
            if st.last is None or seq > st.last:
                st.advance(seq)

    def _drain(self, sock: zmq.Socket, st: ReplicaState) -> None:
        for _ in range(1000):  # then let the other sockets have a turn
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                st.invalid += 1
                self.say(f"{st.source.name}: a message of {len(frames)} frames is not a KV-event batch (topic, "
                         "8-byte seq, payload); not written")
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq in st.replayed:  # published while the replay ran: already written once
                st.replayed.discard(seq)
                continue
            if st.last is None or seq > st.last:
                st.advance(seq)
                st.replayed.clear()  # live is past what the replay wrote: no more duplicates to expect
            elif st.missing(seq):
                st.fill(seq)  # late, but not lost
            else:
                self._restarted(st, seq)
            self._write(st, seq, frames[0], frames[2])

    def _restarted(self, st: ReplicaState, seq: int) -> None:
        """The sequence went back: a new publisher run. What it sent before this message is asked for again."""
        st.restarts += 1
        st.last, st.gaps, st.replayed = seq, [[0, seq - 1]] if seq > 0 else [], set()
        self.say(f"{st.source.name}: the publisher restarted (sequence went back to {seq}); restart {st.restarts}")
        if st.source.name in self.replay_of:
            self._ask_replay(st, 0)

    def _write(self, st: ReplicaState, seq: int, topic: bytes, payload: bytes) -> None:
        m = Message(st.source.name, st.restarts, seq, topic.decode("utf-8", "replace"), payload, time.time())
        try:
            self.sink.add(m, decode_batch(payload, f"{st.source.name} seq {seq}"))
        except CaptureError as e:
            st.invalid += 1
            self.say(f"{e}; not written")
            return
        st.count += 1

    def _monitor_event(self, sock: zmq.Socket, st: ReplicaState) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event == zmq.EVENT_CONNECTED:
                if not st.connected and st.count:
                    self.say(f"{st.source.name}: reconnected to {st.source.endpoint}")
                st.connected = True
            elif event == zmq.EVENT_DISCONNECTED and st.connected:
                st.connected = False
                self.say(f"{st.source.name}: {st.source.endpoint} went away; reconnecting")

    def close(self) -> None:
        for sock in (*self.sub, *self.replay, *self.monitor):
            sock.close()
        self.ctx.term()
