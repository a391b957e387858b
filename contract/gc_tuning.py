"""Garbage-collector settings for the long-running serving processes (gateway and worker).

Each engine step makes a dict per running request on both sides of the worker pipe, so at
1,024 streams the collector's default gen-0 threshold (700 new container objects) ran several
young collections per step, each also walking whatever had just been promoted, while the
hundreds of thousands of objects built at start-up (model config, tokenizer tables, routes,
metric families) sat in the oldest generation to be rescanned. Measured on a step frame of
1,024 outputs with 300k live objects: 2.8 ms to decode with the defaults, 1.3 ms after
`gc.freeze()`, 0.97 ms with a 50k gen-0 threshold as well (0.91 ms with no collector at all).
Reference cycles are still collected, only in larger batches.
"""
from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def tune_gc_for_serving() -> None:
    """Call once start-up is done: freeze what exists, and collect young objects less often."""
    gc.collect()
    gc.freeze()  # start-up objects move to a permanent generation no collection scans
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
