"""Retries counted once: the ids of recent batches (phasewatch ``Export``'s batch_id) and
spans (OTLP's trace + span id), shared by the receivers that need them."""

from __future__ import annotations

import threading
from collections import OrderedDict


class BatchIds:
    """Recently seen batch ids (bounded, oldest forgotten first), so a retried batch is
    counted once; each id can keep the reply its first attempt got."""

    def __init__(self, capacity: int = 65536):
        self._capacity = capacity
        self._ids: OrderedDict[int | bytes, bytes | None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def claim(self, batch_id: int | bytes) -> bool:
        """True if this id is new (and now remembered); False for a repeat."""
        return self.claim_many([batch_id])[0]

    def claim_many(self, ids: list) -> list[bool]:
        """``claim`` for each id in order, under one lock."""
        out = []
        with self._lock:
            known, cap = self._ids, self._capacity
            for batch_id in ids:
                if batch_id in known:
                    out.append(False)
                    continue
                known[batch_id] = None
                if len(known) > cap:
                    known.popitem(last=False)
                out.append(True)
        return out

    def settle(self, batch_id: int | bytes, reply: bytes) -> None:
        """Remember the reply the first attempt of ``batch_id`` got."""
        with self._lock:
            if batch_id in self._ids:
                self._ids[batch_id] = reply

    def reply(self, batch_id: int | bytes) -> bytes | None:
        """The first attempt's reply; None while it is still being ingested."""
        with self._lock:
            return self._ids.get(batch_id)

    def release(self, batch_id: int | bytes) -> None:
        with self._lock:
            self._ids.pop(batch_id, None)
