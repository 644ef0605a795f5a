"""Quantized weights: formats (MXFP4, FP8), the matmul seam, and quantizing a target by policy."""

from jaxspec.quant.formats import (
  FORMATS,
  QTensor,
  is_quantized,
  materialize,
  mxfp4_dequantize,
  mxfp4_quantize,
  nbytes,
  quantize_weight,
  take,
)
from jaxspec.quant.policy import (
  DEFAULT_POLICY,
  default_policy,
  ROLES,
  QuantReport,
  bytes_by_format,
  check_policy,
  policy_from_config,
  quantize,
  quantize_params,
  role_of,
  untie_head,
)

__all__ = [
  "DEFAULT_POLICY",
  "default_policy",
  "FORMATS",
  "QTensor",
  "QuantReport",
  "bytes_by_format",
  "ROLES",
  "check_policy",
  "is_quantized",
  "materialize",
  "mxfp4_dequantize",
  "mxfp4_quantize",
  "nbytes",
  "policy_from_config",
  "quantize",
  "quantize_params",
  "quantize_weight",
  "role_of",
  "take",
  "untie_head",
]
