"""INT4 quantisation and nibble packing: per row (PASK B.5), per row after centring (PASK's centred keys) and per
channel (compacted keys)."""

from .int4 import SMALLEST_FP16, dequantize_int4, pack_int4, quantize_int4, unpack_int4
from .int4_centred import (
    INT4_KEY_LAYOUTS,
    check_int4_keys,
    dequantize_int4_centred,
    key_centre,
    key_centres,
    key_groups,
    quantize_int4_centred,
    served_keys,
)
from .int4_channels import LARGEST_FP16, dequantize_int4_channels, quantize_int4_channels

__all__ = [
    "INT4_KEY_LAYOUTS",
    "check_int4_keys",
    "dequantize_int4_centred",
    "key_centre",
    "key_centres",
    "key_groups",
    "quantize_int4_centred",
    "served_keys",
    "LARGEST_FP16",
    "SMALLEST_FP16",
    "dequantize_int4",
    "dequantize_int4_channels",
    "pack_int4",
    "quantize_int4",
    "quantize_int4_channels",
    "unpack_int4",
]
