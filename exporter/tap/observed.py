"""What the tap saw of one timed request (``Observed``, one ``Choice`` per sequence),
and the records it becomes (``Observed.records()``: ``PhasewatchClient.record``
keywords, one per choice)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Why a request's per-token reading was left out, the request kept (``Observed.records``)
TOKEN_TIMES_DROPPED = ("emissions_exceed_output", "token_counts_exceed_output")


@dataclass
class Choice:
    """What the tap saw of one choice (one sequence) of a request: one, or n with
    ``n > 1`` (vLLM counts each as a request of its own, with the prompt once)."""

    emissions: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per emission, where the server says
    finish_reason: str = ""
    finish_only: float | None = None  # when a chunk with a finish reason and no text came


@dataclass
class Observed:
    """What the tap saw of one timed request."""

    model: str = ""
    arrival: float = 0.0
    end: float = 0.0
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    output_tokens: int | None = None  # all choices together, as the usage says
    status: int = 0
    aborted: str = ""  # why the request did not complete ("client_disconnected", ...)
    trace_parent: str = ""  # "<trace id>-<span id>" of the traceparent sent upstream
    caller_span: str = ""  # the span id of the traceparent the client sent ("" for none)
    path: str = ""  # the API path (/v1/chat/completions or /v1/completions)
    hide_usage: bool = False  # the tap asked for the usage: keep its chunk from the client

    def choice(self, index: int) -> Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = Choice()
        return c

    def settle(self) -> None:
        """Count a text-less finishing chunk as the end-of-sequence token's emission
        when its choice emitted nothing else, or the usage says a token is unaccounted
        for (as vLLM streams a stop: the last token, the end of sequence, decodes to no
        text). A server whose finishing chunk carries no token and whose chunks carry
        several tokens each cannot be told apart without per-chunk usage."""
        emitted = sum(len(c.emissions) for c in self.choices.values())
        for _, c in sorted(self.choices.items()):
            if c.finish_only is None or (c.emissions and c.finish_only < c.emissions[-1]):
                continue
            if not c.emissions or (self.output_tokens is not None
                                   and emitted < self.output_tokens):
                c.emissions.append(c.finish_only)
                c.tokens.append(1 if c.tokens and all(c.tokens) else 0)
                emitted += 1
            c.finish_only = None

    def records(self, dropped: Counter | None = None) -> list[dict]:
        """``PhasewatchClient.record`` keywords: one record per choice, the prompt
        counted by the first (``choice`` > 0 marks the others).

        A per-token reading the output's token count contradicts (more emissions than
        tokens; tokens per emission adding up to more than the output) is the tap's own
        doubt, not the request's: the emission times (or the tokens per emission) are
        left out and counted in ``dropped`` by reason (``TOKEN_TIMES_DROPPED``), and the
        request keeps its first and last token, its counts and its finish reason."""
        choices = sorted(self.choices.items()) or [(0, Choice())]
        emitted = sum(len(c.emissions) for _, c in choices)
        # per choice output tokens: the usage's total when there is one choice; with
        # several, each choice's emissions where the usage shows one token per emission
        one_each = self.output_tokens is not None and self.output_tokens == emitted
        out = []
        for index, c in choices:
            counts = (c.tokens if c.emissions and len(c.tokens) == len(c.emissions)
                      and all(t >= 1 for t in c.tokens) else None)
            output = (self.output_tokens if len(choices) == 1 else
                      len(c.emissions) if one_each else None)
            if output is None:  # no usage: the chunks' token ids, else one per chunk
                output = sum(counts) if counts else len(c.emissions) or None
            times = c.emissions or None
            if counts and output is not None and sum(counts[1:]) > max(output - 1, 0):
                counts = None
                if dropped is not None:
                    dropped["token_counts_exceed_output"] += 1
            if times and output is not None and len(times) > max(output, 1):
                times = counts = None
                if dropped is not None:
                    dropped["emissions_exceed_output"] += 1
            out.append(dict(
                arrival=self.arrival, first_token=c.emissions[0] if c.emissions else None,
                last_token=c.emissions[-1] if c.emissions else None, finish=self.end,
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens, output_tokens=output,
                finish_reason=c.finish_reason or ("abort" if self.aborted else ""),
                token_times=times, token_counts=counts,
                trace_parent=self.trace_parent, choice=index))
        return out
