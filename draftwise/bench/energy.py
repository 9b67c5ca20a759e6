"""Energy and cost: joules, kWh and money per completed request and per 1k output tokens.

Owns one formula, the seed's: energy = average watts × time; cost = kWh × price per kWh. The watts are the
user's measured wall draw (`--watts`); the time is the condition's wall time, so at concurrency C the
machine's draw is shared by the C requests that ran together. Knows nothing of models or HTTP.
"""
from __future__ import annotations

J_PER_KWH = 3.6e6


def energy(watts: float | None, wall_s: float, num_requests: int, num_output_tokens: int,
           price_per_kwh: float | None = None) -> dict | None:
    """Energy (and cost when priced) for a condition that ran `num_requests` in `wall_s` seconds of wall time."""
    if not watts or wall_s <= 0 or num_requests <= 0:
        return None
    joules = watts * wall_s
    out = {"watts": watts, "wall_s": wall_s, "joules": joules,
           "joules_per_request": joules / num_requests,
           "joules_per_1k_tokens": joules / num_output_tokens * 1000 if num_output_tokens else None,
           "wh_per_request": joules / num_requests / 3600}
    if price_per_kwh is not None:
        kwh = joules / J_PER_KWH
        out["price_per_kwh"] = price_per_kwh
        out["cost_per_request"] = kwh * price_per_kwh / num_requests
        out["cost_per_1k_tokens"] = kwh * price_per_kwh / num_output_tokens * 1000 if num_output_tokens else None
    return out
