"""The stored /v1/responses: per-tenant count bound, expiry on an injected clock, isolation
between tenants, and storage switched off."""
import pytest

from gateway.errors import APIError
from gateway.serving.response_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def response(i) -> dict:
    return {"id": f"resp_{i}", "object": "response"}


def turn(i) -> tuple[dict, ...]:
    return ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})


def error_of(call) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


def test_history_is_the_stored_conversation():
    store = ResponseStore(60, 10)
    store.put("a", response(1), turn(1))
    assert store.history("a", "resp_1") == turn(1)
    assert store.history("a", None) == ()
    assert store.get("a", "resp_1").response == response(1)


def test_count_bound_drops_the_oldest_first():
    store = ResponseStore(60, 3)
    for i in range(5):
        store.put("a", response(i), turn(i))
    assert len(store) == 3
    for i in (0, 1):
        assert error_of(lambda i=i: store.get("a", f"resp_{i}")).status == 404
    assert [store.get("a", f"resp_{i}").conversation for i in (2, 3, 4)] == [
        turn(2), turn(3), turn(4)]


def test_each_tenant_has_its_own_count_bound():
    store = ResponseStore(60, 2)
    store.put("a", response(0), turn(0))
    for i in range(1, 6):
        store.put("b", response(i), turn(i))
    assert store.get("a", "resp_0").conversation == turn(0)
    assert len(store) == 3


def test_expiry_on_the_injected_clock():
    clock = Clock()
    store = ResponseStore(10, 100, clock=clock)
    store.put("a", response(1), turn(1))
    clock.now += 5
    store.put("a", response(2), turn(2))
    clock.now += 4.9  # resp_1 is 9.9 s old
    assert store.history("a", "resp_1") == turn(1)
    clock.now += 0.1  # 10 s: gone, and resp_2 (5 s old) is not
    err = error_of(lambda: store.history("a", "resp_1"))
    assert (err.status, err.code, err.param) == (404, "response_not_found",
                                                 "previous_response_id")
    assert store.history("a", "resp_2") == turn(2)
    assert len(store) == 1


def test_expired_responses_of_idle_tenants_are_released_by_any_use():
    clock = Clock()
    store = ResponseStore(10, 100, clock=clock)
    for i in range(3):
        store.put("idle", response(i), turn(i))
    clock.now += 11
    store.put("busy", response(9), turn(9))  # "idle" is never asked for again
    assert len(store) == 1


def test_another_tenants_id_is_as_unknown_as_one_never_made():
    store = ResponseStore(60, 10)
    store.put("a", response(1), turn(1))
    theirs = error_of(lambda: store.get("b", "resp_1"))
    never = error_of(lambda: ResponseStore(60, 10).get("b", "resp_1"))
    assert theirs.status == 404 and theirs.type == "not_found_error"
    assert theirs.body() == never.body()
    assert error_of(lambda: store.delete("b", "resp_1")).status == 404
    assert store.get("a", "resp_1").response == response(1)  # untouched by b's delete


def test_delete_removes_it():
    store = ResponseStore(60, 10)
    store.put("a", response(1), turn(1))
    store.delete("a", "resp_1")
    assert len(store) == 0
    assert error_of(lambda: store.get("a", "resp_1")).code == "response_not_found"
    assert error_of(lambda: store.delete("a", "resp_1")).status == 404


@pytest.mark.parametrize("seconds, count", [(0, 10), (60, 0)])
def test_storage_off_stores_nothing_and_refuses_previous_response_id(seconds, count):
    store = ResponseStore(seconds, count)
    assert not store.enabled
    store.put("a", response(1), turn(1))
    assert len(store) == 0
    assert store.history("a", None) == ()
    err = error_of(lambda: store.history("a", "resp_1"))
    assert (err.status, err.param, err.code) == (400, "previous_response_id",
                                                 "response_storage_disabled")
    assert "stores no responses" in err.message
    assert error_of(lambda: store.get("a", "resp_1")).status == 404
