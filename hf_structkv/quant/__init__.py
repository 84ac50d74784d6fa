"""INT4 row quantisation and nibble packing (PASK B.5)."""

from .int4 import SMALLEST_FP16, dequantize_int4, quantize_int4, unpack_int4

__all__ = ["SMALLEST_FP16", "dequantize_int4", "quantize_int4", "unpack_int4"]
