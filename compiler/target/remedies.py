"""Remedy text for a refused node: the passes that rewrite it, the first SDK that accepts it, a hint."""

from __future__ import annotations


def remedy_text(passes: tuple[str, ...], first_sdk: str | None, hint: str | None = None,
                known: frozenset[str] | None = None) -> str:
    """Passes (marked '(planned)' when `known` pass names are given and lack one), the first SDK
    that accepts, the hint; 'CPU fallback' when nothing helps."""
    parts = [f"pass {p}" + (" (planned)" if known is not None and p not in known else "") for p in passes]
    if first_sdk:
        parts.append(f"--sdk {first_sdk}")
    if hint:
        parts.append(hint)
    return "; ".join(parts) if parts else "CPU fallback"
