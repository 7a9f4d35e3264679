"""Server-sent events of an OpenAI-style answer, read as the bytes arrive.

``EventReader`` times each emission (a content, text, reasoning or tool-call delta; a
chunk's token ids) into an ``Observed``, with the finish reasons and the usage;
``EventReader.whole`` reads a non-streamed answer's body. ``UsageFilter`` passes a
stream on less the usage-only chunk the tap asked for (``--ask-usage``) and the client
did not.
"""

from __future__ import annotations

import json
from collections import Counter

from phasewatch.tap.observed import Observed

MAX_EVENT = 1 << 20  # an SSE event larger than this is not parsed (passed on all the same)


class EventReader:
    """Server-sent events of an OpenAI-style stream, fed the bytes as they arrive."""

    def __init__(self, seen: Observed, counts: Counter):
        self._seen, self._counts = seen, counts
        self._buf = b""
        self._usage_tokens = 0  # the running completion_tokens, when the server sends it

    def feed(self, data: bytes, t: float) -> None:
        self._buf += data
        while True:
            cut = _event_end(self._buf)
            if cut is None:
                if len(self._buf) > MAX_EVENT:
                    self._counts["event_too_large"] += 1
                    self._buf = b""
                return
            event, self._buf = self._buf[:cut[0]], self._buf[cut[1]:]
            self._event(event, t)

    def _event(self, event: bytes, t: float) -> None:
        if event.startswith(b"data:") and event.find(b"\n") < 0 and event.find(b"\r") < 0:
            data = event[5:].lstrip()  # one data line: every OpenAI-style server's event
        else:
            data = b"\n".join(line[5:].lstrip() for line in event.splitlines()
                              if line.startswith(b"data:"))
        if not data or data.strip() == b"[DONE]":
            return
        msg = self._parse(data, "unreadable_event")
        if msg is not None:
            self._message(msg, t, streamed=True)

    def _parse(self, data: bytes, reason: str) -> dict | None:
        """A JSON object, or None (counted under ``reason`` when it is not JSON)."""
        try:
            msg = json.loads(data)
        except ValueError:
            self._counts[reason] += 1
            return None
        return msg if isinstance(msg, dict) else None

    def _message(self, msg: dict, t: float, streamed: bool) -> None:
        seen = self._seen
        if msg.get("model"):  # the served name the server answers with (TGI's own id
            seen.model = str(msg["model"])  # where the client asked for "tgi")
        emitted, finishing = {}, []  # emitted: choice -> its tokens (vLLM's token ids)
        for choice in msg.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            c = seen.choice(index if isinstance(index, int) and 0 <= index < 1024 else 0)
            delta = choice.get("delta") if streamed else choice.get("message")
            ids = choice.get("token_ids")  # vLLM's return_token_ids: completions, chat
            if ids is None and isinstance(delta, dict):
                ids = delta.get("token_ids")
            ids = len(ids) if isinstance(ids, list) and ids else None
            if ids or (isinstance(delta, dict) and (
                    delta.get("content") or delta.get("tool_calls")
                    or delta.get("reasoning_content"))) or choice.get("text"):
                emitted[id(c)] = (c, ids)
            if choice.get("finish_reason"):
                c.finish_reason = str(choice["finish_reason"])
                finishing.append(c)
        usage = msg.get("usage")
        if isinstance(usage, dict):
            _usage(seen, usage)
        if not streamed:
            return
        done = usage.get("completion_tokens") if isinstance(usage, dict) else None
        grew = isinstance(done, int) and done > self._usage_tokens
        # tokens per emission: the chunk's token ids, else the running usage's growth
        # (it belongs to the chunk's one choice: vLLM sends one choice per chunk; with
        # several in one chunk, their tokens are unknown)
        if not emitted and grew:
            emitted = {id(c): (c, None) for c in finishing}
        for c, ids in emitted.values():
            c.emissions.append(t)
            c.tokens.append(ids or (done - self._usage_tokens if grew and (
                len(emitted) == 1) else 0))  # 0: unknown
        if grew:
            self._usage_tokens = done
        if not emitted:
            # a chunk that only finishes: the end-of-sequence token (no text) where the
            # output holds one more token than the emissions so far; decided at the end
            for c in finishing:
                c.finish_only = t

    def whole(self, body: bytes, t: float) -> None:
        """A non-streamed answer: one emission, when its last byte arrived."""
        msg = self._parse(body, "unreadable_body")
        if msg is not None:
            self._message(msg, t, streamed=False)
            if self._seen.output_tokens:
                for c in self._seen.choices.values():
                    c.emissions.append(t)


class UsageFilter:
    """The bytes of a server-sent event stream to pass on, less the usage-only events
    (no choices, a usage) that the tap asked for and the client did not. Whole events
    are passed as they complete (the server's bytes, separators included)."""

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while (cut := _event_end(self._buf)) is not None:
            event, self._buf = self._buf[:cut[1]], self._buf[cut[1]:]
            if not _usage_only(event[:cut[0]]):
                out.append(event)
        return b"".join(out)

    def rest(self) -> bytes:
        """What is left at the end (an event the server did not close): passed on."""
        rest, self._buf = self._buf, b""
        return rest


def _usage_only(event: bytes) -> bool:
    data = b"\n".join(line[5:].lstrip() for line in event.splitlines()
                      if line.startswith(b"data:"))
    if b'"usage"' not in data:
        return False
    try:
        msg = json.loads(data)
    except ValueError:
        return False
    return isinstance(msg, dict) and not msg.get("choices") and bool(msg.get("usage"))


def _event_end(buf: bytes) -> tuple[int, int] | None:
    """(end of the first event, start of the next), or None while incomplete."""
    i = buf.find(b"\n\n")
    if i >= 0 and buf.find(b"\r", 0, i) < 0:  # LF-separated: no CR before it
        return i, i + 2
    found = [(i, i + len(sep)) for sep in (b"\n\n", b"\r\n\r\n", b"\r\r")
             if (i := buf.find(sep)) >= 0]
    return min(found) if found else None


def _usage(seen: Observed, usage: dict) -> None:
    for key, attr in (("prompt_tokens", "prompt_tokens"),
                      ("completion_tokens", "output_tokens")):
        v = usage.get(key)
        if isinstance(v, int) and v >= 0:
            setattr(seen, attr, v)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        seen.cached_prompt_tokens = details["cached_tokens"]
