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

from phasewatch.tap.observed import Choice, Observed

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

    def idle(self) -> bool:
        """Nothing held and no event being passed on unread: the next bytes start
        afresh."""
        return not self._buf and not self._skipping

    def rest(self) -> bytes:
        """What is left at the end (an event the stream did not close)."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._line = self._pos = 0
        self._content_end = -1
        return rest


# The one chunk a stream is made of, one choice with one piece of text and nothing else
# that counts (vLLM's and SGLang's chat and completions chunks), read where its fields
# sit instead of decoding all of it: the head before "choices" is JSON's "key":value
# pairs of strings without escapes, numbers, true, false or null (so no string there
# hides a key), the text is one JSON string, and every other field of the choice and
# of the delta is null. Written as the engines write it (no spaces between tokens).
# Anything else takes the full decode (``_event``), which reads it the same way.
_SIMPLE = rb'"[^"\\\x00-\x1f]*"'
_HEAD = (rb'((?:' + _SIMPLE + rb':(?:' + _SIMPLE
         + rb'|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null),)*)')
_NULLS = rb'(?:"[a-z_]+":null,)*'


def _more_nulls(but: str) -> bytes:
    """Null fields after the one that counts, none of them a key that counts (JSON's last
    of two equal keys wins: a null "content" after the text would unsay it)."""
    return rb'(?:,"(?!(?:' + but.encode() + rb')")[a-z_]+":null)*'


_TEXT = rb'"((?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))+)"'
_PIECE = re.compile(
    rb'\{' + _HEAD + rb'"choices":\[\{"index":(0|[1-9]\d{0,2}),(?:"delta":\{'
    + _NULLS + rb'"content":' + _TEXT + _more_nulls("content") + rb'\}|"text":' + _TEXT
    + rb')' + _more_nulls("index|delta|text") + rb'\}\]' + _more_nulls("choices") + rb'\}')


# The fast read of a whole event: its one data line and the chunk as _PIECE reads it.
_PIECE_EVENT = re.compile(rb"data: ?" + _PIECE.pattern)
# A JSON string's body, not empty (what a template's text may be): most are plain
# (no escape), found in one pass of a character class; the rest take the whole rule
_PLAIN = re.compile(rb'[^"\\\x00-\x1f]+')
_BODY = re.compile(_TEXT[1:-1].replace(b"(", b"(?:", 1))


def _text_between(data: bytes, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` is a JSON string's body, not empty."""
    return (_PLAIN.fullmatch(data, start, end) is not None
            or _BODY.fullmatch(data, start, end) is not None)


TEMPLATES = 8  # the chunk shapes a stream's reader keeps (a choice each, with n > 1)
# Bytes an EventReader holds before it reads them: a stream's pieces are kept as they
# come (two appends on the relay's path) and read in one loop at the end of the stream
# or past this many bytes, where the reading's code and data stay hot in the CPU's
# caches instead of being evicted by the relay's between two chunks.
READ_EVERY = 32 << 10


class EventReader:
    """Server-sent events of an OpenAI-style stream, fed the bytes as they arrive.

    A chunk that ``_PIECE`` reads becomes a template once its head is known good (it
    decoded whole, or a chunk before it had the same head): the bytes before its text
    and after it. A later event that starts and ends with a template's bytes and holds
    a JSON string's body between them is the same chunk with other text (the same id,
    model, creation time and choice, as vLLM and SGLang repeat them): one emission of
    that choice. A piece of the stream that is one such event whole (the server's
    write, as a relay reads it) is read as it is, before any splitting. A chunk whose
    head changes (a time in it) is read where its fields sit (``_PIECE``) where it names
    the model seen; anything else is decoded whole (``_event``).

    ``feed`` keeps the pieces; ``flush`` reads them (``feed`` does every
    ``READ_EVERY`` bytes; the tap at the end of the stream)."""

    def __init__(self, seen: Observed, counts: Counter):
        self._seen, self._counts = seen, counts
        self._events = EventSplitter()
        self._usage_tokens = 0  # the running completion_tokens, when the server sends it
        self._usage_running = False  # a chunk before this one carried a usage: the usage
        # runs (vLLM's continuous_usage_stats), and its growth is the next chunk's tokens
        # (before the text, after it with the blank line, after it as an event, choice)
        self._templates: list[tuple[bytes, bytes, bytes, Choice]] = []
        self._model_key = b""  # '"model":"<the model seen>",' as a chunk's head holds it
        self._last_head = b""  # of the last chunk read where its fields sit
        self._pieces: list[bytes] = []  # fed and not read yet, and when each came
        self._times: list[float] = []
        self._held = 0

    def feed(self, data: bytes, t: float) -> None:
        self._pieces.append(data)
        self._times.append(t)
        self._held += len(data)
        if self._held >= READ_EVERY:
            self.flush()

    def flush(self) -> None:
        """Read the pieces fed since the last read, each event timed by the piece that
        completed it."""
        pieces, times = self._pieces, self._times
        if not pieces:
            return
        self._pieces, self._times, self._held = [], [], 0
        events, templates = self._events, self._templates  # both changed in place only
        for data, t in zip(pieces, times, strict=True):
            if events.idle():  # the piece starts an event: perhaps it is one chunk, whole
                for prefix, suffix, _, c in templates:
                    if (data.startswith(prefix) and data.endswith(suffix)
                            and _text_between(data, len(prefix), len(data) - len(suffix))):
                        c.emissions.append(t)  # one emission, its tokens unknown
                        c.tokens.append(0)
                        break
                else:
                    self._split(data, t)
            else:
                self._split(data, t)

    def _split(self, data: bytes, t: float) -> None:
        events = self._events
        before = events.too_large
        for event, _ in events.feed(data):
            if event:
                self._read(event, t)
        if events.too_large > before:
            self._counts["event_too_large"] += events.too_large - before

    def _read(self, event: bytes, t: float) -> None:
        for prefix, _, suffix, c in self._templates:
            if (event.startswith(prefix) and event.endswith(suffix)
                    and _text_between(event, len(prefix), len(event) - len(suffix))):
                c.emissions.append(t)
                c.tokens.append(0)
                return
        m = _PIECE_EVENT.fullmatch(event)
        key = self._model_key
        if m is not None and key and key in m[1] and m[1].count(b'"model":') == 1:
            index = int(m[2])
            c = self._seen.choice(index if index < 1024 else 0)
            c.emissions.append(t)
            c.tokens.append(0)
            if m[1] == self._last_head:  # the head holds still: a template
                self._template(event, m)
            self._last_head = m[1]
            return
        model = self._seen.model
        ok = self._event(event, t)
        if self._seen.model != model:  # the templates hold the model they were made with
            self._templates.clear()
        if self._seen.model != model or not key:  # the model may be the request's already
            self._model_key = (b'"model":%s,' % json.dumps(
                self._seen.model, ensure_ascii=False).encode()) if self._seen.model else b""
        if ok and m is not None:  # decoded whole: its head is good
            self._template(event, m)

    def _template(self, event: bytes, m: re.Match) -> None:
        """Keep the bytes around the text of ``event`` (read by ``_PIECE``: ``m``)."""
        text = 3 if m[3] is not None else 4
        index = int(m[2])
        suffix = event[m.end(text):]
        templates = self._templates
        templates.insert(0, (event[:m.start(text)], suffix + b"\n\n", suffix,
                             self._seen.choice(index if index < 1024 else 0)))
        del templates[TEMPLATES:]

    def _event(self, event: bytes, t: float) -> bool:
        """Read one event whole; True where it held a JSON object."""
        data = b"\n".join(line[5:].lstrip() for line in event.splitlines()
                          if line.startswith(b"data:"))
        if not data or data.strip() == b"[DONE]":
            return False
        msg = self._parse(data, "unreadable_event")
        if msg is None:
            return False
        self._message(msg, t, streamed=True)
        return True

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
        # tokens per emission: the chunk's token ids, else the running usage's growth
        # (it belongs to the chunk's one choice: vLLM sends one choice per chunk; with
        # several in one chunk, their tokens are unknown). A usage is growth where the
        # usage already ran (an earlier chunk carried one) or nothing was emitted before
        # it; else it is the total of the emissions before it: transformers serve,
        # llama.cpp's server and TGI send it once, on the chunk that finishes.
        own = self._usage_running or not any(c.emissions for c in seen.choices.values())
        self._usage_running = self._usage_running or isinstance(done, int)
        grew = own and isinstance(done, int) and done > self._usage_tokens
        if not emitted and grew:
            emitted = {id(c): (c, None) for c in finishing}
        for c, ids in emitted.values():
            c.emissions.append(t)
            c.tokens.append(ids or (done - self._usage_tokens if grew and (
                len(emitted) == 1) else 0))  # 0: unknown
        if isinstance(done, int) and done > self._usage_tokens:
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
