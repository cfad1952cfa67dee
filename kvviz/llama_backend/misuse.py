"""Bugs of the kind people make with llama.cpp's API, injected through that API only: kvviz makes a
wrong call (or leaves a call out) exactly where an application using llama.cpp would, and llama.cpp
computes what it is told. Not kvviz's fault catalogue (those strike kvviz's own engine): these stand for
mistakes in code that drives llama.cpp, each caught by the oracles with a clean control beside it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Misuse(StrEnum):
    REUSE_WITHOUT_RM = "reuse_without_rm"
    CP_ONE_LONG = "cp_one_long"
    ONE_SEQUENCE = "one_sequence"
    POSITIONS_FROM_ZERO = "positions_from_zero"
    RESTORE_WRONG = "restore_wrong"


@dataclass(frozen=True, kw_only=True)
class MisuseInfo:
    name: Misuse
    call: str  # the call made wrong
    what: str  # what the application does
    pattern: str  # which of the seed's leaks it is
    workload: dict  # requests that meet the misuse (its clean control: the same, called right)
    short: str  # what goes wrong, in a few words
    needs: str  # what a workload must hold for the misuse to strike

    @property
    def title(self) -> str:
        return f"llama.cpp API misuse: {self.short} ({self.call})"

    def never_struck(self) -> str:
        return f"the misuse {self.name} never struck, so its run is a clean run: it needs {self.needs}"


def _req(rid: str, prompt: str, new: int = 6, **kw) -> dict:
    return {"id": rid, "prompt": prompt, "max_new_tokens": new, **kw}


def _workload(*requests: dict) -> dict:
    return {"requests": list(requests), "engine": {"backend": "llama.cpp", "block_size": 16, "num_blocks": 32}}


# B arrives after A ended, sharing the start of A's prompt: it takes A's idle sequence
_AFTER = _workload(_req("A", "The passphrase is red orange yellow. Repeat the passphrase:", 4),
                   _req("B", "The passphrase is green cyan blue. Repeat the passphrase:", 8, arrival_step=8))
# B arrives while A runs, sharing the start of A's prompt: it copies A's cells
_WHILE = _workload(_req("A", "The passphrase is red orange yellow. Repeat the passphrase:", 12),
                   _req("B", "The passphrase is green cyan blue. Repeat the passphrase:", 8, arrival_step=2))
# A and D end; X needs the room their idle cells hold, so both are saved to host memory; C goes on from A's
# history (a fork of A), and only the host cache holds it
_RESTORED = {"requests": [
    _req("A", "The passphrase is red orange yellow.", 4),
    _req("D", "My card number is 4929 1234 5678.", 4, arrival_step=6),
    {"id": "X", "prompt_ids": [45] * 245, "max_new_tokens": 4, "arrival_step": 12},
    _req("C", " Repeat the passphrase:", 6, parent="A", arrival_step=20)],
    "engine": {"backend": "llama.cpp", "block_size": 16, "num_blocks": 16}}
_TOGETHER = _workload(_req("A", "Passphrase: red orange yellow", 6), _req("B", "Password: green cyan blue", 6))


MISUSES = {m.name: m for m in (
    MisuseInfo(name=Misuse.REUSE_WITHOUT_RM, call="llama_memory_seq_rm",
               what="a finished request's sequence id is given to the next request without seq_rm of the "
                    "cells it no longer shares, and the new tokens' positions go on from llama_memory_seq_pos_max "
                    "(llama.cpp refuses any other start): the new request sees the old one's cells",
               pattern="the seed's boundary leak, across requests in time", workload=_AFTER,
               short="a sequence reused without seq_rm",
               needs="a request that arrives after another has ended, its prompt starting as the other's did, so "
                     "that it takes the ended request's sequence"),
    MisuseInfo(name=Misuse.CP_ONE_LONG, call="llama_memory_seq_cp",
               what="the common prefix is measured one token too long, so seq_cp gives the sequence the "
                    "donor's first differing cell too and the request takes it for its own",
               pattern="the seed's boundary leak", workload=_WHILE, short="seq_cp one cell too long",
               needs="a request whose prompt starts as a running or ended request's and goes on differently, "
                     "with at least two tokens of its own"),
    MisuseInfo(name=Misuse.ONE_SEQUENCE, call="llama_batch",
               what="every request is decoded in sequence 0 (llama_batch_get_one's sequence) with positions going "
                    "on from what the cache holds, and no seq_rm between requests: each request sees every token "
                    "of every request before it",
               pattern="the seed's global leak", workload=_TOGETHER, short="every request in one sequence",
               needs="at least two requests"),
    MisuseInfo(name=Misuse.RESTORE_WRONG, call="llama_state_seq_set_data",
               what="the host-memory prompt cache restores the prompt saved last instead of the one the request "
                    "goes on from (a cache looked up by the wrong key), and the request trusts it as its own "
                    "prefix as far as it goes: it reads another conversation's cells",
               pattern="the seed's global leak, through the prompt cache", workload=_RESTORED,
               short="a prompt cache restored into the wrong request",
               needs="a request that goes on from a prompt only the host-memory cache holds, with another "
                     "prompt saved there beside it (the cache must have been full enough to save both)"),
    MisuseInfo(name=Misuse.POSITIONS_FROM_ZERO, call="llama_batch",
               what="a request that reuses a cached prefix numbers its new tokens from 0 instead of from the "
                    "end of the prefix; llama.cpp's batch check refuses positions that do not continue the "
                    "sequence, so the run fails loudly instead of leaking",
               pattern="the seed's positional leak", workload=_AFTER, short="positions restarted at 0",
               needs="a request that finds part of its prompt in the cache"),
)}
