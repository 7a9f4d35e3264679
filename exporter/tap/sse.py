"""Server-sent events of an OpenAI-style answer, read as the bytes arrive.

``EventReader`` times each emission (a content, text, reasoning or tool-call delta; a
chunk's token ids) into an ``Observed``, with the finish reasons and the usage;
``EventReader.whole`` reads a non-streamed answer's body. ``UsageFilter`` passes a
stream on less the usage-only chunk the tap asked for (``--ask-usage``) and the client
did not.
"""

from __future__ import annotations

import json
import re
from collections import Counter

from phasewatch.tap.observed import Observed

MAX_EVENT = 1 << 20  # an SSE event larger than this is not parsed (passed on all the same)


_LINE_END = re.compile(rb"\r\n|\r|\n")


class EventSplitter:
    """A byte stream cut into server-sent events (the bytes up to a blank line; lines end
    in CRLF, LF or CR), in time linear in the bytes whatever the framing: every byte is
    searched once (a scan resumes where the last one stopped), and what is consumed is
    dropped from the front of the buffer.

    ``feed`` returns ``(event, raw)`` pairs in order: ``event`` the event's lines (None
    for bytes passed on unread: an event past ``limit`` bytes, once found too large,
    then the rest of it as it comes), ``raw`` every byte of it, separators included,
    so that the pieces' raws join to the stream exactly. ``too_large`` counts events
    past the limit (one each, however long they run)."""

    def __init__(self, limit: int = MAX_EVENT):
        self._buf = bytearray()
        self._limit = limit
        self._line = 0  # where the current line starts
        self._pos = 0  # where the next search for a line end starts
        self._content_end = -1  # end of the event's last non-blank line (-1: none yet)
        self._partial = False  # bytes of the current line were passed on already
        self._skipping = False  # inside an event found too large
        self.too_large = 0

    def feed(self, data: bytes) -> list[tuple[bytes | None, bytes]]:
        if self._buf or self._skipping or b"\r" in data:
            return self._feed(data)
        # the common case, nothing pending and LF line ends only: events end at "\n\n"
        out, start, limit, n = [], 0, self._limit, len(data)
        while True:
            while start < n and data[start] == 10:  # a blank line where an event would
                out.append((b"", data[start:start + 1]))  # start: an empty event
                start += 1
            i = data.find(b"\n\n", start)
            if i < 0:
                break
            if i - start > limit:
                self.too_large += 1
                out.append((None, data[start:i + 2]))
            else:
                out.append((data[start:i], data[start:i + 2]))
            start = i + 2
        if start < n:
            out += self._feed(data[start:] if start else data)
        return out

    def _feed(self, data: bytes) -> list[tuple[bytes | None, bytes]]:
        buf = self._buf
        buf += data
        out = []
        start, pos = 0, self._pos
        while (m := _LINE_END.search(buf, pos)) is not None:
            a, b = m.span()
            if b == len(buf) and b - a == 1 and buf[a] == 13:  # a lone CR last: perhaps
                # the first half of a CRLF still coming
                pos = a
                break
            if a > self._line or self._partial:  # a line with something on it
                self._content_end, self._partial = a, False
            else:  # a blank line: the event ends
                raw = bytes(buf[start:b])
                if self._skipping:
                    out.append((None, raw))
                    self._skipping = False
                elif self._content_end - start > self._limit:
                    self.too_large += 1
                    out.append((None, raw))
                else:
                    end = self._content_end
                    out.append((bytes(buf[start:end]) if end >= 0 else b"", raw))
                start, self._content_end = b, -1
            self._line = pos = b
        else:
            pos = len(buf)
        if not self._skipping and pos - start > self._limit:
            self._skipping = True
            self.too_large += 1
        if self._skipping and pos > start:  # pass on what was read of it, keep no more
            out.append((None, bytes(buf[start:pos])))
            self._partial = self._partial or pos > self._line
            self._line = pos
            self._content_end = -1
            start = pos
        del buf[:start]  # bytearray drops its front without moving the rest
        self._pos = pos - start
        self._line -= start
        if self._content_end >= 0:
            self._content_end -= start
        return out

    def rest(self) -> bytes:
        """What is left at the end (an event the stream did not close)."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._line = self._pos = 0
        self._content_end = -1
        return rest


# The one chunk a stream is made of, one choice with one piece of text and nothing else
# that counts (vLLM's and SGLang's chat and completions chunks), read where its fields
# sit instead of decoding all of it: the head before "choices" holds no brace, bracket
# or backslash (so no string there hides a key), the text is one JSON string, and every
# other field of the choice and of the delta is null. Anything else, or a model other
# than the one seen, takes the full decode (``_event``), which reads it the same way.
_NULLS = rb'(?:"[a-z_]+":null,)*'
_MORE_NULLS = rb'(?:,"[a-z_]+":null)*'
_TEXT = rb'"((?:[^"\\]|\\.)+)"'
_PIECE = re.compile(
    rb'\{([^\\{}\[\]]*)"choices":\[\{"index":(\d{1,3}),(?:"delta":\{' + _NULLS
    + rb'"content":' + _TEXT + _MORE_NULLS + rb'\}|"text":' + _TEXT + rb')'
    + _MORE_NULLS + rb'\}\]' + _MORE_NULLS + rb'\}')


class EventReader:
    """Server-sent events of an OpenAI-style stream, fed the bytes as they arrive."""

    def __init__(self, seen: Observed, counts: Counter):
        self._seen, self._counts = seen, counts
        self._events = EventSplitter()
        self._usage_tokens = 0  # the running completion_tokens, when the server sends it
        self._model = b""  # '"model":"<the model seen>"', as the chunks' heads carry it

    def feed(self, data: bytes, t: float) -> None:
        events = self._events
        before = events.too_large
        for event, _ in events.feed(data):
            if event:
                self._event(event, t)
        if events.too_large > before:
            self._counts["event_too_large"] += events.too_large - before

    def _event(self, event: bytes, t: float) -> None:
        if event.startswith(b"data:") and event.find(b"\n") < 0 and event.find(b"\r") < 0:
            data = event[5:].lstrip()  # one data line: every OpenAI-style server's event
            m = _PIECE.fullmatch(data)
            if m is not None and self._model and self._model in m[1]:
                index = int(m[2])  # one emission of one choice, its tokens unknown
                c = self._seen.choice(index if index < 1024 else 0)
                c.emissions.append(t)
                c.tokens.append(0)
                return
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
            msg = None
        if not isinstance(msg, dict):  # not JSON, or JSON but not an object
            self._counts[reason] += 1
            return None
        return msg

    def _message(self, msg: dict, t: float, streamed: bool) -> None:
        seen = self._seen
        if msg.get("model"):  # the served name the server answers with (TGI's own id
            seen.model = str(msg["model"])  # where the client asked for "tgi")
            self._model = json.dumps({"model": seen.model}, separators=(",", ":"),
                                     ensure_ascii=False)[1:-1].encode()
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
        self._events = EventSplitter()

    def feed(self, data: bytes) -> bytes:
        return b"".join(raw for event, raw in self._events.feed(data)
                        if not (event and _usage_only(event)))

    def rest(self) -> bytes:
        """What is left at the end (an event the server did not close): passed on."""
        return self._events.rest()


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


def _usage(seen: Observed, usage: dict) -> None:
    for key, attr in (("prompt_tokens", "prompt_tokens"),
                      ("completion_tokens", "output_tokens")):
        v = usage.get(key)
        if isinstance(v, int) and v >= 0:
            setattr(seen, attr, v)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        seen.cached_prompt_tokens = details["cached_tokens"]
