"""Prometheus metrics of the server: counters and latency histograms (updated by the engine
thread, rendered by ``GET /metrics``) plus gauges read from the engine when rendered."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Sequence

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense (upper bounds ``buckets``)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    """The server's metrics. ``gauges`` maps a gauge name to ``(help, f() -> {labels: value})``
    (labels as a preformatted ``'{k="v"}'`` string, ``""`` for none), read at render time."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], dict[str, float]]]]) -> None:
        self._lock = threading.Lock()
        self.gauges = gauges
        self.ttft = Histogram(
            "kvplan_time_to_first_token_seconds",
            "seconds from a request reaching the engine to its first generated token",
            TTFT_BUCKETS,
        )
        self.per_token = Histogram(
            "kvplan_time_per_output_token_seconds",
            "seconds between a request's consecutive generated tokens",
            TOKEN_BUCKETS,
        )
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # of finished requests: resumed from the prefix cache
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.rejected = 0  # requests refused with 503 (queue full)
        self.step_errors = 0

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def tokens(self, num: int, seconds_each: float | None) -> None:
        """``num`` new tokens of one request; ``seconds_each``: the latency of each (None for
        a request's first batch, whose latency is the time to first token)."""
        with self._lock:
            self.generation_tokens += num
            if seconds_each is not None and num:
                self.per_token.observe(seconds_each, num)

    def request_added(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def request_finished(self, reason: str | None, num_cached_tokens: int = 0) -> None:
        """A request finished; ``num_cached_tokens``: its prompt tokens the prefix cache
        served (not computed) at its last admission."""
        with self._lock:
            self.cached_prompt_tokens += num_cached_tokens
            key = reason or "unknown"
            self.finished[key] = self.finished.get(key, 0) + 1

    def count_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def count_step_error(self) -> None:
        with self._lock:
            self.step_errors += 1

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        lines: list[str] = []
        for name, (help_text, read) in self.gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            lines += [f"{name}{labels} {value}" for labels, value in read().items()]
        with self._lock:
            counters = [
                ("kvplan_generation_tokens_total", "generated tokens", {"": self.generation_tokens}),
                ("kvplan_prompt_tokens_total", "prompt tokens of added requests", {"": self.prompt_tokens}),
                ("kvplan_prompt_tokens_cached_total", "prompt tokens of finished requests served by the prefix cache (not computed)", {"": self.cached_prompt_tokens}),
                (
                    "kvplan_requests_finished_total",
                    "engine requests finished, by finish reason",
                    {f'{{finish_reason="{k}"}}': v for k, v in sorted(self.finished.items())},
                ),
                ("kvplan_requests_rejected_total", "requests refused because the queue was full", {"": self.rejected}),
                ("kvplan_engine_step_errors_total", "engine steps that raised", {"": self.step_errors}),
            ]  # fmt: skip
            for name, help_text, values in counters:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                lines += [f"{name}{labels} {value}" for labels, value in values.items()]
            lines += self.ttft.render() + self.per_token.render()
        return "\n".join(lines) + "\n"
