"""The real-vLLM workloads' load client (``tests/engines/steady_load.py``): with
``--mix-on`` / ``--mix-off`` a mix stream sends only in the first ``on`` seconds of every
``on + off`` from the start (``verdict_runs.WORKLOADS["mixed"]``: bursts of prefills, and
stretches without any), and a group without them sends throughout. Driven with a fake
client (the real one is the engine venv's ``openai``)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from tests.engines.steady_load import group_stats, stream_loop


class _Stream:
    def __init__(self):
        self._chunks = [SimpleNamespace(choices=[SimpleNamespace(text="x")], usage=None),
                        SimpleNamespace(choices=[], usage=SimpleNamespace(
                            completion_tokens=1, prompt_tokens=3))]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._chunks:
            raise StopAsyncIteration
        await asyncio.sleep(0.01)
        return self._chunks.pop(0)


class _Client:
    """Answers every completion after 10 ms, and notes when each was sent."""

    def __init__(self):
        self.sent: list[float] = []
        self.completions = SimpleNamespace(create=self._create)

    async def _create(self, **_):
        self.sent.append(time.time())
        return _Stream()


def _run(group: dict, seconds: float) -> tuple[list[float], dict]:
    client, begun = _Client(), time.time()
    stats = group_stats(group, begun)
    asyncio.run(stream_loop(client, "m", group, begun + seconds, [0], stats))
    return [t - begun for t in client.sent], stats


def test_a_mix_stream_sends_in_bursts_and_waits_between_them():
    group = {"prompt_words": 4, "max_tokens": 1, "think": 0.0, "on": 0.3, "off": 0.3}
    sent, stats = _run(group, 1.5)
    assert stats["failed"] == 0 and stats["finished"] == len(sent)
    into = [t % 0.6 for t in sent]
    assert all(x < 0.3 + 0.02 for x in into), into  # (a request sent at the burst's end)
    bursts = {int(t // 0.6) for t in sent}
    assert bursts == {0, 1, 2}, sent  # every burst sent, none skipped
    assert len(sent) >= 3 * 8  # ~14 requests a burst, one after another


def test_a_group_without_bursts_sends_throughout():
    group = {"prompt_words": 4, "max_tokens": 1, "think": 0.0}
    sent, _ = _run(group, 0.9)
    assert any(0.35 < t % 0.6 < 0.55 for t in sent), sent
