"""Stored /v1/responses answers, per tenant, for `previous_response_id` and GET / DELETE.

Each stored response keeps its Response object and its conversation: the messages it was
asked (the earlier conversation it continued included, its instructions not, as OpenAI's
API carries instructions over to no later turn) and the assistant's answer. A later request
naming it continues that conversation.

Memory is bounded on both axes: at most `max_per_tenant` responses per tenant (the oldest
dropped first) and none older than `seconds`. Each one is bounded too: its conversation was
admitted, so it fit the model's context, and a chained one shares the message strings of the
one before it rather than copying them. Tenants come from the key file, so the whole store is
at most tenants x max_per_tenant x one context's text. Expiry is lazy: expired responses are
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


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was answered
    conversation: tuple[dict, ...]  # chat messages: the input history plus the answer
    expires_at: float  # on the store's clock


class ResponseStore:
    """Responses by tenant, then by id in insertion order (= expiry order)."""

    def __init__(self, seconds: float, max_per_tenant: int,
                 clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.max_per_tenant = max_per_tenant
        self.clock = clock
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}

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
        responses[response["id"]] = StoredResponse(response, conversation,
                                                   self.clock() + self.seconds)
        while len(responses) > self.max_per_tenant:
            responses.popitem(last=False)  # the oldest first

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
        responses = self._tenants[tenant]
        del responses[response_id]
        if not responses:
            del self._tenants[tenant]

    def _expire(self) -> None:
        now = self.clock()
        for tenant in list(self._tenants):
            responses = self._tenants[tenant]
            while responses and next(iter(responses.values())).expires_at <= now:
                responses.popitem(last=False)
            if not responses:
                del self._tenants[tenant]

    def _not_found(self, response_id: str, param: str | None) -> APIError:
        kept = f"responses are kept {self.seconds:g} s" if self.enabled else \
            "this server stores no responses"
        return APIError(404, f"no response {response_id!r:.80} is stored for this key; {kept}",
                        "not_found_error", param, NOT_FOUND_CODE)
