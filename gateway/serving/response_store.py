"""Stored /v1/responses answers, per tenant, for `previous_response_id` and GET / DELETE.

Each stored response keeps its Response object and its conversation: the messages it was
asked (the earlier conversation it continued included, its instructions not, as OpenAI's
API carries instructions over to no later turn) and the assistant's answer. A later request
naming it continues that conversation.

Memory is bounded on three axes: at most `max_per_tenant` responses per tenant and at most
`max_bytes_per_tenant` bytes of their text (the oldest dropped first), and none older than
`seconds`. Each one is bounded too: its conversation was admitted, so it fit the model's
context, and its echoed fields are capped (metadata, user). A response's bytes count its whole
conversation, although a chained one shares the message strings of the one before it: an
overcount, so the cap holds whatever is shared. Tenants come from the key file, so the whole
store is at most tenants x max_bytes_per_tenant. Expiry is lazy: expired responses are
dropped whenever the store is touched, from the oldest, which is also the order of insertion
since every response lives equally long.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import APIError, bad_request

NOT_FOUND_CODE = "response_not_found"
# 64 MiB a tenant: hundreds of full-context conversations, while 1000 of them at a long
# context's worth of text each would be gigabytes
MAX_BYTES_PER_TENANT = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was answered
    conversation: tuple[dict, ...]  # chat messages: the input history plus the answer
    expires_at: float  # on the store's clock
    size: int = 0  # bytes it counts against its tenant's cap (`_size`)


class ResponseStore:
    """Responses by tenant, then by id in insertion order (= expiry order)."""

    def __init__(self, seconds: float, max_per_tenant: int,
                 clock: Callable[[], float] = time.monotonic,
                 max_bytes_per_tenant: int = MAX_BYTES_PER_TENANT):
        self.seconds = seconds
        self.max_per_tenant = max_per_tenant
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self.clock = clock
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}  # per tenant: the sum of its responses' sizes

    @property
    def enabled(self) -> bool:
        return self.seconds > 0 and self.max_per_tenant > 0

    def __len__(self) -> int:
        return sum(map(len, self._tenants.values()))

    def put(self, tenant: str, response: dict, conversation: tuple[dict, ...]) -> None:
        if not self.enabled:
            return
        self._expire()
        responses = self._tenants.setdefault(tenant, OrderedDict())
        stored = StoredResponse(response, conversation, self.clock() + self.seconds,
                                _size(response, conversation))
        self._drop(tenant, response["id"])
        responses[response["id"]] = stored
        self._bytes[tenant] = self._bytes.get(tenant, 0) + stored.size
        while len(responses) > 1 and (len(responses) > self.max_per_tenant or
                                      self._bytes[tenant] > self.max_bytes_per_tenant):
            self._pop_oldest(tenant)  # the newest stays, so a chain can always go on

    def bytes_of(self, tenant: str) -> int:
        """The bytes the tenant's stored responses count against its cap."""
        return self._bytes.get(tenant, 0)

    def get(self, tenant: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The tenant's stored response, or 404: another tenant's id is as unknown as one
        never made, so ids say nothing about other tenants."""
        self._expire()
        responses = self._tenants.get(tenant)
        found = responses.get(response_id) if responses is not None else None
        if found is None:
            raise self._not_found(response_id, param)
        return found

    def history(self, tenant: str, previous_id: str | None) -> tuple[dict, ...]:
        """The conversation a request continues: () without previous_response_id, 400 when
        storage is off, 404 when the id is unknown, expired or another tenant's."""
        if previous_id is None:
            return ()
        if not self.enabled:
            raise bad_request("previous_response_id cannot be used: this server stores no "
                              "responses (--responses-store-seconds is 0); send the whole "
                              "conversation as input", "previous_response_id",
                              code="response_storage_disabled")
        return self.get(tenant, previous_id, "previous_response_id").conversation

    def delete(self, tenant: str, response_id: str) -> None:
        self.get(tenant, response_id)  # 404 alike for unknown and other tenants' ids
        self._drop(tenant, response_id)
        if not self._tenants[tenant]:
            self._forget(tenant)

    def _expire(self) -> None:
        now = self.clock()
        for tenant in list(self._tenants):
            responses = self._tenants[tenant]
            while responses and next(iter(responses.values())).expires_at <= now:
                self._pop_oldest(tenant)
            if not responses:
                self._forget(tenant)

    def _pop_oldest(self, tenant: str) -> None:
        _, stored = self._tenants[tenant].popitem(last=False)
        self._bytes[tenant] -= stored.size

    def _drop(self, tenant: str, response_id: str) -> None:
        stored = self._tenants[tenant].pop(response_id, None)
        if stored is not None:
            self._bytes[tenant] -= stored.size

    def _forget(self, tenant: str) -> None:
        del self._tenants[tenant]
        self._bytes.pop(tenant, None)

    def _not_found(self, response_id: str, param: str | None) -> APIError:
        kept = f"responses are kept {self.seconds:g} s" if self.enabled else \
            "this server stores no responses"
        return APIError(404, f"no response {response_id!r:.80} is stored for this key; {kept}",
                        "not_found_error", param, NOT_FOUND_CODE)


def _size(response: dict, conversation: tuple[dict, ...]) -> int:
    """Bytes of the text a stored response holds: its messages (the answer among them, the
    very string its output holds) and the fields it echoes (instructions, user, metadata)."""
    texts = [m.get("content") or "" for m in conversation]
    texts += [response.get("instructions") or "", response.get("user") or ""]
    texts += [k + v for k, v in (response.get("metadata") or {}).items()]
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
