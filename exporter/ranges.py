"""Index ranges of the exporter's ``--adapt`` option (no torch)."""

from __future__ import annotations

import re


def parse_range(spec: str, upper: int, what: str) -> list[int]:
    """Parse '2-8' (inclusive) or '3' or '1,4-5' into sorted unique indices in [0, upper)."""
    indices: set[int] = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise ValueError(f"bad --adapt range {spec!r}: use e.g. '2-8' or '1,3'")
        lo = int(match.group(1))
        hi = int(match.group(2) or lo)
        if lo > hi or hi >= upper:
            raise ValueError(f"--adapt {spec!r} is outside the model's {what} 0..{upper - 1}")
        indices.update(range(lo, hi + 1))
    return sorted(indices)
