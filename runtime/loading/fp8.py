"""DeepSeek's block-scaled FP8 weights, dequantized at load.

DeepSeek-V3/R1 ship most matrices as float8_e4m3fn `weight` [out, in] beside a float32
`weight_scale_inv` [ceil(out / 128), ceil(in / 128)]: each 128 x 128 block of the weight is
multiplied by its one scale (the checkpoint's `quantization_config`: quant_method "fp8",
fmt "e4m3", weight_block_size [128, 128]). The matrix becomes float32 here, in place of the
FP8 tensor (the scales are dropped), and goes on to the served form like any float weight
(float, or int8/int4 through LinearMaker): nothing else keeps a copy. Activations are not
quantized: a step computes in the model's dtype (DeepSeek's `activation_scheme: dynamic`
quantizes them per step in its own kernels; serving them unquantized is the exact product
of the dequantized weights).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("runtime.startup")

SCALE_SUFFIX = ".weight_scale_inv"


class FP8Error(ValueError):
    """A quantized checkpoint this loader does not serve (named), or a tensor it cannot read."""


def block_size(quantization_config: dict | None) -> tuple[int, int]:
    """The (rows, columns) of one scale's block, from a config.json's quantization_config;
    any other quantization method or format is refused by name."""
    q = quantization_config or {}
    method = q.get("quant_method")
    if method != "fp8":
        raise FP8Error(f"quantization_config quant_method {method!r} is not served "
                       "(served: DeepSeek's block-scaled fp8)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise FP8Error(f"fp8 format {fmt!r} is not served (served: e4m3)")
    size = q.get("weight_block_size")
    if not (isinstance(size, list | tuple) and len(size) == 2 and all(
            isinstance(s, int) and s > 0 for s in size)):
        raise FP8Error(f"fp8 weight_block_size {size!r}: needs [rows, columns] "
                       "(per-tensor or per-channel fp8 is not served)")
    return int(size[0]), int(size[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """weight [out, in] (fp8) times each block's scale: float32 [out, in]. The last blocks
    of a dimension that is not a multiple of the block are partial (their scale covers what
    there is)."""
    if weight.dim() != 2:
        raise FP8Error(f"an fp8 weight of shape {tuple(weight.shape)} (needs 2 dimensions)")
    out, inp = weight.shape
    bo, bi = block
    rows, cols = -(-out // bo), -(-inp // bi)
    if tuple(scale_inv.shape) != (rows, cols):
        raise FP8Error(f"scales {tuple(scale_inv.shape)} for a weight {(out, inp)} in "
                       f"{bo}x{bi} blocks (needs {(rows, cols)})")
    s = scale_inv.to(torch.float32)
    if out % bo == 0 and inp % bi == 0:  # one float32 copy, scaled in place
        w = weight.to(torch.float32)
        w.view(rows, bo, cols, bi).mul_(s[:, None, :, None])
        return w
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32)
    padded[:out, :inp] = weight.to(torch.float32)
    padded.view(rows, bo, cols, bi).mul_(s[:, None, :, None])
    return padded[:out, :inp].contiguous()


def dequantize_checkpoint(weights: dict[str, torch.Tensor],
                          quantization_config: dict | None) -> int:
    """Every fp8 `X.weight` with its `X.weight_scale_inv` replaced, in `weights`, by its
    float32 dequantization (the scales removed); returns how many. An fp8 tensor without its
    scales, or scales without their weight, is refused by name."""
    scales = [n for n in weights if n.endswith(SCALE_SUFFIX)]
    fp8 = [n for n, t in weights.items() if _is_fp8(t)]
    if not scales and not fp8:
        return 0
    block = block_size(quantization_config)
    for name in scales:
        target = name[:-len(SCALE_SUFFIX)] + ".weight"
        weight = weights.get(target)
        if weight is None:
            raise FP8Error(f"{name} without its weight {target}")
        if weight.dtype != torch.float8_e4m3fn:
            raise FP8Error(f"{target} has fp8 scales but is {weight.dtype} (served: "
                           "float8_e4m3fn)")
        weights[target] = dequantize_block_fp8(weight, weights.pop(name), block)
    left = [n for n in fp8 if _is_fp8(weights[n])]
    if left:
        raise FP8Error(f"fp8 tensors without {SCALE_SUFFIX} scales: {left[:5]}"
                       f"{' and more' if len(left) > 5 else ''}")
    log.info("fp8: %d block-scaled weights (%dx%d blocks) dequantized to float at load",
             len(scales), *block)
    return len(scales)


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
