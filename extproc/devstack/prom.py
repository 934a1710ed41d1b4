"""Read Prometheus text (``/metrics``) with prometheus_client's parser, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def metric_samples(text: str) -> Iterator[Sample]:
    """Every sample in Prometheus text (``name`` is the sample's full name, e.g. ``x_total``,
    ``x_bucket``); ValueError if the text is malformed."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The value of one series, or None if absent.

    ``labels`` None: the series of ``name`` without labels. Otherwise the first series of
    ``name`` whose labels include these (``{}``: any series of ``name``)."""
    for sample in metric_samples(text):
        if sample.name != name:
            continue
        if labels is None:
            if not sample.labels:
                return float(sample.value)
        elif all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    return None


def metric_sums(text: str) -> dict[str, float]:
    """The sum over every series of each sample name."""
    sums: dict[str, float] = {}
    for sample in metric_samples(text):
        sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    return sums
