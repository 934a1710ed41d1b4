"""The agent's proxy: when a streamed response has its first token, and the prefill ledger."""

from __future__ import annotations

from llmworker.proxy import FirstTokenWatcher, PrefillLedger


def test_first_token_is_the_first_event_with_generated_text() -> None:
    watcher = FirstTokenWatcher()
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    assert not watcher.feed(role)
    assert not watcher.feed(b'data: {"choices":[{"delta":{"cont')
    assert watcher.feed(b'ent":"Hi"}}]}\r\n\r\n')
    completions = FirstTokenWatcher()
    assert not completions.feed(b": keep-alive\n\ndata: [DONE]\n\n")
    assert completions.feed(b'data: {"choices":[{"text":" the"}]}\n\n')


def test_ledger_charges_the_least_loaded_rank_and_releases_once() -> None:
    changes: list[list[int]] = []
    ledger = PrefillLedger(lambda: changes.append(ledger.per_rank()))
    ledger.resize(2)
    a, b, c = ledger.add(100), ledger.add(30), ledger.add(50)
    assert (a.rank, b.rank, c.rank) == (0, 1, 1)
    ledger.release(a)
    ledger.release(a)
    assert ledger.per_rank() == [0, 80]
    assert changes == [[100, 0], [100, 30], [100, 80], [0, 80]]
