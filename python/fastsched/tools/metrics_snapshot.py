"""One scrape of a Prometheus ``/metrics`` page, and the arithmetic between two scrapes.

``fastsched top`` needs rates and recent latency quantiles, but a scrape only holds
counters and cumulative histograms since the server started. Both come from the
difference of two scrapes, computed the way Prometheus' ``rate()`` and
``histogram_quantile()`` do, so the numbers agree with a dashboard built on the same
metrics: a counter that went down was reset (the server restarted) and counts from 0,
and a quantile is interpolated linearly within the bucket that holds its rank.

Samples are keyed by the name they have in the text (``fastsched:prompt_tokens_total``,
not the family name prometheus_client's parser gives a counter), so the names here are
the ones ``curl /metrics`` shows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram as exposed: counts of observations ≤ each upper bound,
    bounds ascending, the last one +Inf."""

    upper_bounds: tuple[float, ...]
    cumulative_counts: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative_counts[-1] if self.cumulative_counts else 0.0

    def since(self, earlier: Histogram) -> Histogram:
        """The observations made after ``earlier`` was scraped (bucket by bucket). After a
        reset (a bucket went down, or the bounds changed) that is everything in ``self``."""
        if earlier.upper_bounds != self.upper_bounds:
            return self
        pairs = list(zip(self.cumulative_counts, earlier.cumulative_counts, strict=True))
        if any(now < then for now, then in pairs):
            return self
        return Histogram(self.upper_bounds, tuple(now - then for now, then in pairs), self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile(q)``: the bucket whose cumulative count first
        reaches rank ``q × count``, interpolated linearly from its lower bound (0 for the
        first bucket); a rank in the +Inf bucket gives the highest finite bound. None
        without observations or without a +Inf bucket (Prometheus: NaN)."""
        if not 0 < q <= 1:
            raise ValueError(f"a quantile is in (0, 1], got {q}")
        bounds, counts = self.upper_bounds, self.cumulative_counts
        if len(bounds) < 2 or bounds[-1] != math.inf or self.count == 0:
            return None
        rank = q * self.count
        b = next((i for i, c in enumerate(counts[:-1]) if c >= rank), len(counts) - 1)
        if b == len(counts) - 1:
            return bounds[-2]
        if b == 0 and bounds[0] <= 0:
            return bounds[0]
        lower, below = (0.0, 0.0) if b == 0 else (bounds[b - 1], counts[b - 1])
        return lower + (bounds[b] - lower) * (rank - below) / (counts[b] - below)


@dataclass(frozen=True)
class Sample:
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Snapshot:
    """Everything one scrape returned, taken at ``taken_at`` (monotonic seconds)."""

    taken_at: float
    samples: Mapping[str, tuple[Sample, ...]]  # every non-histogram sample, by its name in the text
    histograms: Mapping[str, Histogram]  # by family name (``…_seconds``, without ``_bucket``)

    def value(self, name: str, **labels: str) -> float | None:
        """The sample's value, summed over its label sets if it has any (those that have
        ``labels``, when given); None when absent."""
        samples = [s for s in self.samples.get(name, ()) if labels.items() <= s.labels.items()]
        return sum(s.value for s in samples) if samples else None

    def mean(self, name: str) -> float | None:
        """The sample's value averaged over its label sets (e.g. a fraction per engine); None when absent."""
        samples = self.samples.get(name)
        return sum(s.value for s in samples) / len(samples) if samples else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: value}`` for a metric with one label, e.g. rejections by reason."""
        values: dict[str, float] = {}
        for s in self.samples.get(name, ()):
            if label in s.labels:
                values[s.labels[label]] = values.get(s.labels[label], 0.0) + s.value
        return values


def parse_metrics(text: str, taken_at: float) -> Snapshot:
    """Parses a Prometheus text exposition; ValueError when it is not one. Histogram
    buckets with labels other than ``le`` are summed over them; their ``_sum`` and
    ``_count`` samples are also kept as samples, with their labels."""
    samples: dict[str, list[Sample]] = {}
    histograms: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            for s in family.samples:
                samples.setdefault(s.name, []).append(Sample(s.labels, s.value))
            continue
        buckets: dict[float, float] = {}
        total = 0.0
        for s in family.samples:
            if s.name == family.name + "_bucket":
                bound = float(s.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + s.value
            else:  # _sum and _count, kept by label too (the goodput valve's error by target)
                samples.setdefault(s.name, []).append(Sample(s.labels, s.value))
                if s.name == family.name + "_sum":
                    total += s.value
        bounds = tuple(sorted(buckets))
        histograms[family.name] = Histogram(bounds, tuple(buckets[b] for b in bounds), total)
    return Snapshot(taken_at, {name: tuple(s) for name, s in samples.items()}, histograms)


def counter_increase(now: float, then: float) -> float:
    """How much a counter grew between two scrapes; one that went down was reset to 0 in
    between (the server restarted) and grew by ``now`` since."""
    return now - then if now >= then else now
