"""INT4 quantisation and nibble packing: per row (PASK B.5) and per channel (compacted keys)."""

from .int4 import SMALLEST_FP16, dequantize_int4, pack_int4, quantize_int4, unpack_int4
from .int4_channels import LARGEST_FP16, dequantize_int4_channels, quantize_int4_channels

__all__ = [
    "LARGEST_FP16",
    "SMALLEST_FP16",
    "dequantize_int4",
    "dequantize_int4_channels",
    "pack_int4",
    "quantize_int4",
    "quantize_int4_channels",
    "unpack_int4",
]
