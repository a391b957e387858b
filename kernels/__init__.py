"""The one place that picks an implementation for each op.

Triton kernels run on CUDA; everywhere else (and when INFERSTACK_KERNELS=ref) the torch
references run. Callers import the op names from here and never from the files directly.
"""
from __future__ import annotations

import os

from kernels.activation import silu_and_mul_ref
from kernels.paged_attention import context_slots, paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rotary_cos_sin
from kernels.store_kv import store_kv_ref

FORCE_REFERENCE = os.environ.get("INFERSTACK_KERNELS", "").lower() == "ref"

# Only references exist so far; the Triton versions slot in here, chosen per device.
rms_norm = rms_norm_ref
apply_rotary = apply_rotary_ref
silu_and_mul = silu_and_mul_ref
store_kv = store_kv_ref
paged_decode_attention = paged_decode_attention_ref
prefill_attention = prefill_attention_ref

__all__ = [
    "rms_norm", "apply_rotary", "rotary_cos_sin", "silu_and_mul", "store_kv",
    "paged_decode_attention", "prefill_attention", "context_slots", "FORCE_REFERENCE",
]
