"""One request's measurements, and the per-request figures derived from them.

All times are seconds on the runner's monotonic clock (time.perf_counter), relative to the run's
start. `intended` is when the load shape wanted the request sent and `sent` when the client
actually sent it: a saturated client shows up as sent - intended (schedule lag), and latencies
are measured from `sent` while `e2e_intended` measures from `intended` (no coordinated omission).

Token timing: `chunks` holds (arrival time, tokens) for every stream message that carried output
text: one arrival each, however many tokens it carries (a multi-byte character split over two
tokens arrives as one message). The first token is the first such message (a role-only chunk
is not a token). How many tokens a message carries is decided when the stream ends
(`count_source`, loadtest/stream.py): the server's usage.completion_tokens spread over the
messages ("usage", the default), logprob entries ("logprobs", exact), or one per message
("chunks": an estimate, used when the server reports no usage or when asked to).

Per-token figures divide by tokens, never by messages: when a message carries k > 1 tokens the
gap since the previous message is split evenly into k per-token gaps, so the per-token
inter-token latencies of a request sum to last_token - first_token, there are tokens - 1 of
them, and their mean equals its TPOT. Tokens beyond the first in the first message get gaps of
0. The gaps between arrivals themselves (what a reader of the stream waits) are chunk_gaps().
A token that carries no text (an end-of-sequence token the usage counts) is timed with the
last message.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    id: str
    tenant: str
    priority: int | None
    workload: str
    protocol: str
    intended: float
    sent: float = -1.0  # < 0: never sent (cancelled while waiting for a slot)
    end: float = 0.0
    status: int | None = None  # HTTP status (101 for a WebSocket request that got frames)
    error: str | None = None  # kind: "http_429", "stream_error", "truncated", "bad_frame", ...
    error_message: str | None = None
    chunks: list = field(default_factory=list)  # [(t, tokens)], tokens: int
    usage: dict | None = None
    prompt_chars: int = 0
    output_chars: int = 0
    streamed: bool = True  # False for non-streaming: TTFT = e2e, no ITL or TPOT
    warmup: bool = False  # sent during warm-up or cool-down: excluded from the figures
    cost: dict | None = None
    cost_source: str = "none"
    count_source: str = "chunks"  # how tokens per message were counted: usage|logprobs|chunks

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def was_sent(self) -> bool:
        return self.sent >= 0.0

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def e2e_intended(self) -> float:
        return self.end - self.intended

    @property
    def schedule_lag(self) -> float:
        return self.sent - self.intended

    @property
    def tokens_arrived(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def completion_tokens(self) -> int:
        """Tokens the server reported (usage), else those that arrived."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return self.tokens_arrived

    @property
    def prompt_tokens(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    @property
    def usage_mismatch(self) -> bool:
        """The server's completion_tokens contradict the stream: an exact count (logprobs)
        differs, or the server reports fewer tokens than messages that carried text (each
        carries at least one). A count estimated one per message is no evidence either way: a
        message may carry several tokens (one multi-byte character split over two)."""
        reported = (self.usage or {}).get("completion_tokens")
        if not self.ok or reported is None:
            return False
        if self.count_source == "logprobs":
            return int(reported) != self.tokens_arrived
        return int(reported) < len(self.chunks)

    def itls(self) -> list[float]:
        """Per-token inter-token latencies (seconds), len = tokens_arrived - 1."""
        gaps: list[float] = []
        if not self.chunks or not self.streamed:
            return gaps
        t0, n0 = self.chunks[0]
        gaps.extend([0.0] * (n0 - 1))
        prev = t0
        for t, n in self.chunks[1:]:
            if n > 0:
                gaps.extend([(t - prev) / n] * n)
                prev = t
        return gaps

    def chunk_gaps(self) -> list[float]:
        """Gaps between consecutive token messages (one per arrival, whatever it carries)."""
        if not self.streamed:
            return []
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def max_itl(self) -> float:
        return max(self.itls(), default=0.0)

    @property
    def tpot(self) -> float | None:
        """(last token - first token) / (tokens - 1); 0 for a reply of one token."""
        n = self.tokens_arrived
        if not self.chunks or not self.streamed:
            return None
        if n <= 1:
            return 0.0
        return (self.chunks[-1][0] - self.chunks[0][0]) / (n - 1)

    def as_json(self) -> dict:
        return {"id": self.id, "tenant": self.tenant, "priority": self.priority,
                "protocol": self.protocol, "intended": self.intended, "sent": self.sent,
                "end": self.end, "status": self.status, "error": self.error,
                "error_message": self.error_message, "ttft": self.ttft, "tpot": self.tpot,
                "e2e": self.e2e, "tokens_arrived": self.tokens_arrived,
                "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "warmup": self.warmup,
                "cost": self.cost, "cost_source": self.cost_source,
                "count_source": self.count_source}
