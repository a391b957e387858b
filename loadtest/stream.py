"""Reading OpenAI stream chunks (the same JSON over SSE and WebSocket) into a RequestRecord.

A chunk is a token message when it carries output text (chat delta.content or
reasoning_content, completion text) or, with --count-tokens logprobs, logprob entries.
How many tokens a message carries (--count-tokens), settled when the stream ends:
  usage     (default) the reported completion_tokens, spread over the messages by the UTF-8
            length of their text (a multi-byte character is often several tokens of a
            byte-level vocabulary, which a server sends as one message once the character is
            whole). A stream without usage falls back to one per message (count_source
            "chunks", an estimate); a usage below the number of messages contradicts the
            stream and is flagged (RequestRecord.usage_mismatch)
  logprobs  the number of logprob entries (exact; the request asks for logprobs)
  chunks    one per message whatever the usage says (an estimate, never called a mismatch)
An {"error": ...} object inside the stream is a failure even after HTTP 200.
"""
from __future__ import annotations

from loadtest.record import RequestRecord

COUNT_MODES = ("usage", "logprobs", "chunks")


class ChunkReader:
    def __init__(self, record: RequestRecord, count_mode: str = "usage"):
        self.record = record
        self.count_mode = count_mode
        self.finished = False  # a finish_reason arrived
        self._bytes: list[int] = []  # UTF-8 length of each message's text: its weight

    def feed(self, t: float, chunk) -> None:
        rec = self.record
        if not isinstance(chunk, dict):
            return self.fail("bad_frame", "a stream message is not a JSON object")
        if "error" in chunk and chunk["error"]:
            err = chunk["error"]
            msg = err.get("message") if isinstance(err, dict) else str(err)
            return self.fail("stream_error", msg)
        if chunk.get("usage"):
            rec.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                return self.fail("bad_frame", "a choice is not an object")
            text = _text(choice)
            n = self._tokens(choice, text)
            if n:
                rec.chunks.append((t, n))
                self._bytes.append(len(text.encode()))
                rec.output_chars += len(text)
            if choice.get("finish_reason"):
                self.finished = True
        return None

    def _tokens(self, choice: dict, text: str) -> int:
        if self.count_mode == "logprobs":
            lp = choice.get("logprobs") or {}
            entries = lp.get("content") if "content" in lp else lp.get("tokens")
            return len(entries or ())
        return 1 if text else 0

    def fail(self, kind: str, message: str | None) -> None:
        if self.record.error is None:
            self.record.error, self.record.error_message = kind, message

    def close(self, t: float) -> None:
        """End of the stream: check it finished, settle the tokens each message carried."""
        rec = self.record
        rec.end = t
        if rec.error is None and not self.finished:
            self.fail("truncated", "the stream ended without a finish_reason")
        if rec.ok:
            rec.count_source = self._settle()

    def _settle(self) -> str:
        if self.count_mode == "logprobs":
            return "logprobs"
        if self.count_mode == "usage" and spread_usage(self.record, self._bytes):
            return "usage"
        return "chunks"


def _text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def spread_usage(rec: RequestRecord, weights: list[int]) -> bool:
    """Give the reported completion tokens to the messages in proportion to `weights` (their
    text's UTF-8 length), each at least one, rounding by largest remainders. True when the
    messages now carry exactly the reported tokens; False (left alone) without a usage or with
    fewer tokens than messages."""
    value = (rec.usage or {}).get("completion_tokens")
    if value is None:
        return False
    reported, n = int(value), len(rec.chunks)
    if n == 0 or reported <= n:
        return reported >= n  # as many as messages: one each already
    weights = [w or 1 for w in weights]
    shares = [reported * w / sum(weights) for w in weights]
    counts = [max(1, int(s)) for s in shares]
    by_remainder = sorted(range(n), key=lambda i: counts[i] - shares[i])
    i = 0
    while sum(counts) < reported:
        counts[by_remainder[i % n]] += 1
        i += 1
    while sum(counts) > reported:  # only when max(1, ...) lifted small messages
        counts[max(range(n), key=lambda j: counts[j] - shares[j] if counts[j] > 1
                   else -1e9)] -= 1
    rec.chunks = [(t, k) for (t, _), k in zip(rec.chunks, counts)]
    return True
