"""Worker-side admission (docs/worker.md): limits from flag and env, FIFO slots, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extproc.devstack import async_wait_until as wait_until
from llmworker.admission import (
    Admission,
    AdmissionConfig,
    AdmissionConfigError,
    Overloaded,
)


def test_off_when_n_is_unset_and_q_is_then_not_read() -> None:
    config, warning = AdmissionConfig.from_env(None, {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1"})
    assert not config.enabled and warning is None


def test_n_from_env_and_q_default() -> None:
    config, _ = AdmissionConfig.from_env(None, {"DYN_ENGINE_REQUEST_LIMIT": " 4 "})
    assert (config.engine_request_limit, config.queue_limit) == (4, 16)


def test_flag_wins_over_env() -> None:
    env = {"DYN_ENGINE_REQUEST_LIMIT": "4", "DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "2"}
    config, _ = AdmissionConfig.from_env("7", env)
    assert (config.engine_request_limit, config.queue_limit) == (7, 2)


@pytest.mark.parametrize(
    ("flag", "env", "named"),
    [
        ("0", {}, "--engine-request-limit='0'"),
        ("-3", {}, "--engine-request-limit='-3'"),
        ("2.5", {}, "--engine-request-limit='2.5'"),
        (None, {"DYN_ENGINE_REQUEST_LIMIT": "abc"}, "DYN_ENGINE_REQUEST_LIMIT='abc'"),
        (None, {"DYN_ENGINE_REQUEST_LIMIT": "0"}, "DYN_ENGINE_REQUEST_LIMIT='0'"),
        ("2", {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1"}, "DYN_DYNAMO_REQUEST_QUEUE_LIMIT='1'"),
        ("2", {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "x"}, "DYN_DYNAMO_REQUEST_QUEUE_LIMIT='x'"),
    ],
)
def test_bad_limits_name_the_setting_and_value(
    flag: str | None, env: dict[str, str], named: str
) -> None:
    with pytest.raises(AdmissionConfigError) as info:
        AdmissionConfig.from_env(flag, env)
    assert named in str(info.value)


def test_overload_status_follows_env() -> None:
    config, warning = AdmissionConfig.from_env("1", {"DYN_HTTP_OVERLOAD_STATUS_CODE": "429"})
    assert config.overload_status == 429 and warning is None
    rejection = Admission(config).rejection()
    assert rejection.status == 429
    assert rejection.body == (
        b'{"message":"Server overloaded: worker at capacity","type":"Too Many Requests","code":429}'
    )
    assert rejection.headers == {"x-worker-overloaded": "1", "content-type": "application/json"}
    config, warning = AdmissionConfig.from_env("1", {"DYN_HTTP_OVERLOAD_STATUS_CODE": "abc"})
    assert config.overload_status == 529 and warning is not None


async def _hold(admission: Admission, entered: list[int], i: int, release: asyncio.Event) -> None:
    async with admission.slot():
        entered.append(i)
        await release.wait()


async def test_n_in_engine_q_waiting_fifo_then_rejected() -> None:
    admission = Admission(AdmissionConfig(engine_request_limit=2, queue_limit=2))
    release = asyncio.Event()
    entered: list[int] = []
    tasks = [asyncio.create_task(_hold(admission, entered, i, release)) for i in range(4)]
    await wait_until(lambda: admission.queued == 2, what="two waiting")
    assert admission.in_engine == 2 and entered == [0, 1]
    with pytest.raises(Overloaded):
        async with admission.slot():
            pass
    assert admission.rejected_total == 1
    release.set()
    await asyncio.gather(*tasks)
    assert entered == [0, 1, 2, 3]
    assert (admission.in_engine, admission.queued) == (0, 0)


async def test_cancelled_waiter_leaves_the_queue() -> None:
    admission = Admission(AdmissionConfig(engine_request_limit=1, queue_limit=2))
    release = asyncio.Event()
    entered: list[int] = []
    first = asyncio.create_task(_hold(admission, entered, 0, release))
    second = asyncio.create_task(_hold(admission, entered, 1, release))
    third = asyncio.create_task(_hold(admission, entered, 2, release))
    await wait_until(lambda: admission.queued == 2, what="two waiting")
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert admission.queued == 1
    release.set()
    await asyncio.gather(first, third)
    assert entered == [0, 2]
    assert (admission.in_engine, admission.queued) == (0, 0)


async def test_slot_granted_as_the_waiter_is_cancelled_is_passed_on() -> None:
    admission = Admission(AdmissionConfig(engine_request_limit=1, queue_limit=2))
    release = asyncio.Event()
    release.set()
    entered: list[int] = []
    held = admission.slot()
    await held.__aenter__()
    second = asyncio.create_task(_hold(admission, entered, 1, release))
    third = asyncio.create_task(_hold(admission, entered, 2, release))
    await wait_until(lambda: admission.queued == 2, what="two waiting")
    await held.__aexit__(None, None, None)  # hands the slot to `second` ...
    second.cancel()  # ... which is cancelled before it runs
    await asyncio.wait_for(asyncio.gather(second, third, return_exceptions=True), 5)
    assert second.cancelled() and entered == [2]
    assert (admission.in_engine, admission.queued) == (0, 0)


async def test_errors_inside_the_block_release_the_slot() -> None:
    admission = Admission(AdmissionConfig(engine_request_limit=1, queue_limit=2))
    with pytest.raises(RuntimeError):
        async with admission.slot():
            raise RuntimeError("boom")
    assert admission.in_engine == 0


async def test_metrics_series() -> None:
    admission = Admission(AdmissionConfig(engine_request_limit=1, queue_limit=2))
    registry = CollectorRegistry()
    registry.register(admission.collector())
    async with admission.slot():
        text = generate_latest(registry).decode()
    assert "dynamo_rejection_request_total 0.0" in text
    assert "dynamo_engine_request 1.0" in text
    assert "dynamo_request_queue 0.0" in text


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (None, {"DYN_ENGINE_REQUEST_LIMIT": "  "}, (None, 16, 529)),  # blank = unset
        (" +3 ", {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": " "}, (3, 16, 529)),
        (5, {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": " 2 "}, (5, 2, 529)),
        ("1", {"DYN_HTTP_OVERLOAD_STATUS_CODE": " 503 "}, (1, 16, 503)),
        (
            None,
            {"DYN_HTTP_OVERLOAD_STATUS_CODE": "429", "dyn_engine_request_limit": "4"},
            (None, 16, 429),
        ),
    ],
)
def test_settings_values_from_flag_and_env(
    flag: str | int | None, env: dict[str, str], expected: tuple[int | None, int, int]
) -> None:
    config, warning = AdmissionConfig.from_env(flag, env)
    assert (config.engine_request_limit, config.queue_limit, config.overload_status) == expected
    assert warning is None


@pytest.mark.parametrize(
    ("flag", "env", "message"),
    [
        ("", {}, "--engine-request-limit='' is invalid: expected an integer >= 1"),
        ("1e3", {}, "--engine-request-limit='1e3' is invalid: expected an integer >= 1"),
        (None, {"DYN_ENGINE_REQUEST_LIMIT": "4.0"}, "DYN_ENGINE_REQUEST_LIMIT='4.0' is invalid"),
        ("4", {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "-2"}, "expected an integer >= 2"),
        # N is named first; Q is read only once N is valid
        ("x", {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1"}, "--engine-request-limit='x'"),
    ],
)
def test_setting_errors_name_source_value_and_expectation(
    flag: str | None, env: dict[str, str], message: str
) -> None:
    with pytest.raises(AdmissionConfigError) as info:
        AdmissionConfig.from_env(flag, env)
    assert message in str(info.value)
    assert "DYN_DYNAMO_REQUEST_QUEUE_LIMIT" not in str(info.value) or flag == "4"


def test_admission_settings_are_immutable() -> None:
    import pydantic

    from llmworker.admission import AdmissionSettings

    s = AdmissionSettings.load("2", {})
    with pytest.raises(pydantic.ValidationError):
        s.queue_limit = 3
