"""The gateway's operations: `/metrics` in the Prometheus text format, and per-client rate limits.

`/metrics` (text format 0.0.4, https://prometheus.io/docs/instrumenting/exposition_formats/; written here, no
client library) exposes:

    ajet_gateway_requests_total{route, status}        counter: answered requests by route template and status
    ajet_gateway_request_duration_seconds{route}      histogram: time to the last byte (a stream: to its end)
    ajet_gateway_feedback_total{source}               counter: rewards recorded ("client", "judge")
    ajet_gateway_swaps_total                          counter: weight changes served since the gateway started
                                                      (updates served, rollbacks)
    ajet_gateway_gate_evaluations_total               counter: held-out evaluations the gate ran
    ajet_gateway_gate_refusals_total                  counter: new policies the gate refused (not served)
    ajet_gateway_rollbacks_total                      counter: rollbacks done
    ajet_gateway_policy_version                       gauge: the version now served
    ajet_gateway_sessions{state}                      gauge: sessions by state (open, closed, rated, trained, ...)
    ajet_gateway_best_of_requests_total               counter: requests answered by best-of-N

Rate limits: a token bucket per client (`rate_limit_rps` tokens added a second, at most `rate_limit_burst` saved
up); the client is the name of its key of `gateway.keys` (a caller cannot make up a new one), else (the secret, or
no keys) the request's source address, whatever `X-Ajet-Session` it sends (a new session is never a new bucket,
and with a secret the clients do not share one). The gateway app picks the bucket (ajet/gateway/app.py). A request finding the bucket
empty gets a 429 with `Retry-After` (whole seconds until a token is there).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)   # histogram upper bounds, seconds
MAX_KEYS = 100_000   # rate-limit buckets kept (the least recently used are forgotten beyond it)


class RequestMetrics:
    """Counters and the latency histogram of answered requests (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.hist: dict[str, list[int]] = {}          # route -> counts per bucket (+Inf last)
        self.hist_sum: dict[str, float] = {}

    def observe(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request of `route` (a template, never a raw path) with `status`, `seconds` long."""
        with self._lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
            counts = self.hist.setdefault(route, [0] * (len(BUCKETS_S) + 1))
            counts[next((i for i, b in enumerate(BUCKETS_S) if seconds <= b), len(BUCKETS_S))] += 1
            self.hist_sum[route] = self.hist_sum.get(route, 0.0) + seconds

    def render(self, counts: dict[str, int], states: dict[str, int], version: int, first_version: int) -> str:
        """The Prometheus text: these request figures plus the session book's `counts`, `states` and versions."""
        out = ["# HELP ajet_gateway_requests_total Requests answered, by route and HTTP status.",
               "# TYPE ajet_gateway_requests_total counter"]
        with self._lock:
            for (route, status), n in sorted(self.requests.items()):
                out.append(f'ajet_gateway_requests_total{{route="{_esc(route)}",status="{status}"}} {n}')
            out += ["# HELP ajet_gateway_request_duration_seconds Time to a request's last byte (a stream: its end).",
                    "# TYPE ajet_gateway_request_duration_seconds histogram"]
            for route, per in sorted(self.hist.items()):
                cum = 0
                for b, n in zip([*BUCKETS_S, math.inf], per):
                    cum += n
                    le = "+Inf" if b == math.inf else repr(b)
                    out.append(f'ajet_gateway_request_duration_seconds_bucket{{route="{_esc(route)}",le="{le}"}} {cum}')
                out.append(f'ajet_gateway_request_duration_seconds_sum{{route="{_esc(route)}"}} {self.hist_sum[route]}')
                out.append(f'ajet_gateway_request_duration_seconds_count{{route="{_esc(route)}"}} {cum}')
        out += ["# HELP ajet_gateway_feedback_total Rewards recorded, by source.",
                "# TYPE ajet_gateway_feedback_total counter",
                f'ajet_gateway_feedback_total{{source="client"}} {counts.get("feedback", 0)}',
                f'ajet_gateway_feedback_total{{source="judge"}} {counts.get("judged", 0)}',
                "# HELP ajet_gateway_swaps_total Weight changes served since the gateway started.",
                "# TYPE ajet_gateway_swaps_total counter",
                f"ajet_gateway_swaps_total {counts.get('swaps', max(0, version - first_version))}",
                "# HELP ajet_gateway_gate_evaluations_total Held-out evaluations run by the gate.",
                "# TYPE ajet_gateway_gate_evaluations_total counter",
                f"ajet_gateway_gate_evaluations_total {counts.get('gate_evaluations', 0)}",
                "# HELP ajet_gateway_gate_refusals_total New policies the gate refused to serve.",
                "# TYPE ajet_gateway_gate_refusals_total counter",
                f"ajet_gateway_gate_refusals_total {counts.get('gate_refusals', 0)}",
                "# HELP ajet_gateway_rollbacks_total Rollbacks to an earlier policy version.",
                "# TYPE ajet_gateway_rollbacks_total counter",
                f"ajet_gateway_rollbacks_total {counts.get('rollbacks', 0)}",
                "# HELP ajet_gateway_read_timeouts_total Connections closed because a request's headers and body "
                "did not arrive within gateway.read_timeout_s.",
                "# TYPE ajet_gateway_read_timeouts_total counter",
                f"ajet_gateway_read_timeouts_total {counts.get('read_timeouts', 0)}",
                "# HELP ajet_gateway_policy_version The policy version served now.",
                "# TYPE ajet_gateway_policy_version gauge",
                f"ajet_gateway_policy_version {version}",
                "# HELP ajet_gateway_best_of_requests_total Requests answered by best-of-N.",
                "# TYPE ajet_gateway_best_of_requests_total counter",
                f"ajet_gateway_best_of_requests_total {counts.get('best_of_requests', 0)}",
                "# HELP ajet_gateway_sessions Sessions held, by state.",
                "# TYPE ajet_gateway_sessions gauge"]
        out += [f'ajet_gateway_sessions{{state="{st}"}} {n}' for st, n in sorted(states.items())]
        return "\n".join(out) + "\n"


class RateLimiter:
    """Token buckets per key.

    Args:
        rps: tokens added per second (requests per second sustained), > 0.
        burst: most tokens a bucket holds (requests at once after a quiet spell), >= 1.
        clock: monotonic seconds (`time.monotonic`).
    """

    def __init__(self, rps: float, burst: int, clock: Callable[[], float] = time.monotonic):
        if rps <= 0 or burst < 1:
            raise ValueError(f"rate limit needs rps > 0 and burst >= 1, got {rps}, {burst}")
        self.rps, self.burst, self._clock = rps, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}   # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str) -> int | None:
        """Take one token of `key`'s bucket: None when there was one, else the whole seconds (>= 1) until one
        is there (the 429's Retry-After)."""
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rps)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                out = None
            else:
                self._buckets[key] = (tokens, now)
                out = max(1, math.ceil((1.0 - tokens) / self.rps))
            while len(self._buckets) > MAX_KEYS:          # dicts keep insertion order: the oldest first
                self._buckets.pop(next(iter(self._buckets)))
            return out


def _esc(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
