"""How many batch lines may start now: the judgement of idle capacity.

Batch lines start only while online demand leaves room, judged at each of the runner's turns
from what the dispatcher already knows, with no guess at future traffic:
- nothing online waits in the gateway's queue (an online request waiting means the workers
  are busy with online work, or about to be);
- the workers taking new requests keep a margin of their request slots and of their KV blocks
  free (`margin`, a fraction, at least one slot): an online request that arrives finds a free
  slot and starts at the next step, without waiting for any batch line to be preempted;
- at most `max_queued` batch lines wait in the queue at once, so the queue never fills with
  batch work and an online request never queues behind a flood of it.
A batch line that started anyway when an online burst arrives is preempted on its worker (the
least urgent class: gateway/serving/dispatch.py) and resumes later.
"""
from __future__ import annotations

import math
from typing import Any


def idle_slots(dispatcher: Any, queue: Any, margin: float, max_queued: int,
               starting: int) -> int:
    """Batch lines that may be admitted now (0 when online demand leaves no room);
    `starting`: the runner's lines admitted or being admitted and not yet on a worker."""
    if queue.online_waiting > 0 or starting >= max_queued:
        return 0
    workers = [w for w in dispatcher.workers if w.alive and w.index not in dispatcher.draining
               and w.max_num_seqs > 0]
    if not workers:
        return 0
    slots = sum(w.max_num_seqs for w in workers)
    free = sum(max(0, w.free_slots) for w in workers)
    kept = max(1, math.ceil(margin * slots))
    blocks = sum(w.num_blocks for w in workers)
    if blocks and sum(max(0, w.free_blocks) for w in workers) < margin * blocks:
        return 0
    return max(0, min(free - kept, max_queued) - starting)
