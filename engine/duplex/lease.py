"""Leases: a session lives while its client shows activity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.config import DuplexRuntimeConfig

ExpiryReason = Literal["idle_timeout", "disconnected", "max_duration"]


@dataclass
class Lease:
    created_at: float
    last_activity: float
    generation: int = 1
    detached_at: float | None = None
    warned_for: float | None = None  # the expiry deadline a warning was already sent for

    def activity(self, now: float) -> None:
        self.last_activity = now

    def detach(self, now: float) -> None:
        self.last_activity = now
        if self.detached_at is None:
            self.detached_at = now

    def attach(self, now: float) -> None:
        """Only ``resume`` clears the grace clock (and bumps the generation)."""
        self.last_activity = now
        self.detached_at = None
        self.warned_for = None

    def deadline(
        self, cfg: DuplexRuntimeConfig, *, busy: bool
    ) -> tuple[float, ExpiryReason] | None:
        """When this lease expires if nothing happens, and why (None: never).

        ``busy``: turns are queued or running; an idle lease never expires under them.
        """
        candidates: list[tuple[float, ExpiryReason]] = []
        if self.detached_at is not None:
            candidates.append((self.detached_at + cfg.disconnect_grace_s, "disconnected"))
        if cfg.idle_ttl_s is not None and not busy:
            candidates.append((self.last_activity + cfg.idle_ttl_s, "idle_timeout"))
        if cfg.max_session_s is not None:
            candidates.append((self.created_at + cfg.max_session_s, "max_duration"))
        return min(candidates) if candidates else None
