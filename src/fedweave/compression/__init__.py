"""Update compression (docs/compression.md): registered compressors (:data:`fedweave.registry.COMPRESSORS`),
their bit-exact encoded messages, and the star round's compression stage with error feedback."""

from fedweave.compression.codec import Encoded, Field
from fedweave.compression.compressors import QSGD, Compressor, EFSign, Int8, RandK, TopK, received, wire_bits
from fedweave.compression.stage import UploadCompression, build_compressor, upload_compression

__all__ = [
    "QSGD",
    "Compressor",
    "EFSign",
    "Encoded",
    "Field",
    "Int8",
    "RandK",
    "TopK",
    "UploadCompression",
    "build_compressor",
    "received",
    "upload_compression",
    "wire_bits",
]
