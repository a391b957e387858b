"""What the rest of the gateway reads of the batch tier (gateway/batch/): its line counts, for
/metrics, the live feed and the console. The tier's runner provides it; None on the state
means the tier is off."""
from __future__ import annotations

from typing import Protocol


class BatchTierView(Protocol):
    @property
    def batches_open(self) -> int:
        """Batches validating, in progress or finalizing."""

    @property
    def lines_waiting(self) -> int:
        """Lines of open batches not yet admitted to a worker (no result recorded)."""

    @property
    def lines_running(self) -> int:
        """Lines admitted and not yet finished (queued at the gateway or on a worker)."""
