"""The registered upload compressors (``compression.upload.name``, docs/compression.md).

Each is a dataclass of its options with ``encode(v, rng) -> Encoded`` and ``decode(Encoded) -> v_hat``, both
on the host; ``rng`` is the ``("compression", round, client, message)`` stream for the compressors that
draw (``random``), so a run draws the same on every backend and device. ``error_feedback`` is the default
of whether the stage keeps each client's residual ``e_i`` and compresses ``v + e_i`` (Karimireddy et al.
2019; Stich et al. 2018); every compressor takes it as an option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import torch

from fedweave.compression.codec import Encoded, field_floats, float_bits, float_field, index_bits, uint_field
from fedweave.config import ConfigError
from fedweave.registry import COMPRESSORS

KEY = "compression.upload"  # the config key that errors name


class Compressor:
    """An upload compressor: what it sends for one vector and how the server reads it back."""

    error_feedback: bool = False
    #: True: ``encode`` draws from the message's seed stream
    random: ClassVar[bool] = False
    #: True: ``E[decode(encode(v))] = v`` over the draws (without error feedback)
    unbiased: ClassVar[bool] = False

    def check(self, size: int) -> None:
        """Refuse options that do not fit a vector of ``size`` values (a ConfigError naming the key)."""

    def encode(self, v: torch.Tensor, rng: torch.Generator | None) -> Encoded:
        """The message for vector ``v`` (1-d, on the host)."""
        raise NotImplementedError

    def decode(self, e: Encoded) -> torch.Tensor:
        """The vector the receiver rebuilds from ``e`` (1-d, on the host, in ``e.dtype``)."""
        raise NotImplementedError


@dataclass
class _Sparse(Compressor):
    """k of the d coordinates: ``k`` values, or ``ratio`` of them (rounded up)."""

    k: int | None = None
    ratio: float | None = None

    def __post_init__(self) -> None:
        if (self.k is None) == (self.ratio is None):
            raise ConfigError(f"{KEY}: give exactly one of k (values kept) and ratio (fraction kept)")
        if self.k is not None and self.k < 1:
            raise ConfigError(f"{KEY}.k must be >= 1, got {self.k}")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"{KEY}.ratio must be in (0, 1], got {self.ratio}")

    def kept(self, size: int) -> int:
        """The number of coordinates sent for a vector of ``size`` values."""
        if self.k is not None:
            return self.k
        # the ratio as written (0.07, not the float above it whose product with 100 is 7.000000000000001); float()
        # first, as a numpy scalar's repr names its type
        return max(1, math.ceil(Fraction(repr(float(self.ratio))) * size))

    def check(self, size: int) -> None:
        if self.kept(size) > size:
            raise ConfigError(f"{KEY}.k ({self.k:.6g}) exceeds the {size} values of a message; choose k <= {size}")


@COMPRESSORS.register("topk")
@dataclass
class TopK(_Sparse):
    """The k coordinates of largest magnitude (Stich et al. 2018; Aji & Heafield 2017): k indices of
    ``ceil(log2 d)`` bits and k values at the run's float width. With error feedback by default."""

    error_feedback: bool = True

    def encode(self, v: torch.Tensor, rng: torch.Generator | None) -> Encoded:
        idx = torch.topk(v.abs(), self.kept(len(v)), sorted=False).indices.sort().values
        fields = (uint_field("indices", idx, index_bits(len(v))), float_field("values", v[idx]))
        return Encoded(fields, len(v), v.dtype)

    def decode(self, e: Encoded) -> torch.Tensor:
        out = torch.zeros(e.size, dtype=e.dtype)
        out[torch.from_numpy(e["indices"].astype("int64"))] = field_floats(e["values"], e.dtype)
        return out


@COMPRESSORS.register("randk")
@dataclass
class RandK(_Sparse):
    """k coordinates drawn uniformly without replacement from the message's stream, which the server draws
    too: only the k values travel. Without error feedback (the default) the server scales them by d/k, the
    unbiased random sparsifier (Wangni et al. 2018); with error feedback they are unscaled (Stich et al. 2018),
    the contractive form that error feedback needs."""

    error_feedback: bool = False
    random: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True

    def encode(self, v: torch.Tensor, rng: torch.Generator | None) -> Encoded:
        idx = torch.randperm(len(v), generator=rng)[: self.kept(len(v))].sort().values
        return Encoded((float_field("values", v[idx]),), len(v), v.dtype, {"indices": idx})

    def decode(self, e: Encoded) -> torch.Tensor:
        values = field_floats(e["values"], e.dtype)
        if not self.error_feedback:
            values = values * (e.size / len(values))
        out = torch.zeros(e.size, dtype=e.dtype)
        out[e.shared["indices"]] = values
        return out


@COMPRESSORS.register("qsgd")
@dataclass
class QSGD(Compressor):
    """QSGD with s levels (Alistarh et al. 2017, Sec. 3.1): ``||v||_2 sign(v_i) xi_i / s`` with ``xi_i`` the
    stochastic rounding of ``s |v_i| / ||v||_2`` to a neighbouring integer (unbiased). On the wire: the norm
    at the float width, one sign bit and ``ceil(log2(s + 1))`` level bits per value (fixed-width codes, not
    the paper's Elias coding). With error feedback the server scales the decoded vector by ``1 / (1 + omega)``,
    ``omega = min(d / s^2, sqrt(d) / s)`` the variance bound of Lemma 3.1: the contraction error feedback's
    analysis needs (Stich et al. 2018; Karimireddy et al. 2019), as random-k then drops its d/k; unscaled, the
    residual grew without bound once ``omega > 1`` (d > s^2)."""

    levels: int = 4
    error_feedback: bool = False
    random: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.levels < 1:
            raise ConfigError(f"{KEY}.levels must be >= 1, got {self.levels}")
        if self.levels > 2**63 - 1:  # the levels travel as int64 codes
            raise ConfigError(f"{KEY}.levels must be at most 2^63 - 1 (the codes are int64), got {self.levels:.6g}")

    def encode(self, v: torch.Tensor, rng: torch.Generator | None) -> Encoded:
        s, norm, peak = self.levels, v.norm(), v.abs().max()
        if (norm == 0 or norm.isinf()) and 0 < peak < math.inf:  # the squares under- or overflowed, not the norm
            norm = (v / peak).norm() * peak
        u = torch.rand(len(v), generator=rng, dtype=v.dtype)  # drawn even for a zero vector: one stream use
        scaled = v.abs() / norm * s if norm > 0 else torch.zeros_like(v)
        low = scaled.floor()
        level = (low + (u < scaled - low).to(v.dtype)).clamp(max=s)  # floating error may round s up
        fields = (
            float_field("norm", norm.reshape(1)),
            uint_field("signs", (v < 0).to(torch.uint8), 1),
            uint_field("levels", level.to(torch.int64), s.bit_length()),
        )
        return Encoded(fields, len(v), v.dtype)

    def decode(self, e: Encoded) -> torch.Tensor:
        norm = field_floats(e["norm"], e.dtype)
        sign = 1.0 - 2.0 * torch.from_numpy(e["signs"].astype("float64")).to(e.dtype)
        level = torch.from_numpy(e["levels"].astype("float64")).to(e.dtype)
        out = norm * sign * level / self.levels
        if self.error_feedback:
            omega = min(e.size / self.levels**2, math.sqrt(e.size) / self.levels)
            out = out / (1 + omega)
        return out


@COMPRESSORS.register("efsign")
@dataclass
class EFSign(Compressor):
    """EF-SignSGD's scaled sign (Karimireddy et al. 2019, Alg. 1): ``(||v||_1 / d) sign(v)``, with error
    feedback by default. On the wire: the scale at the float width and one bit per value (a zero value
    is sent as +)."""

    error_feedback: bool = True

    def encode(self, v: torch.Tensor, rng: torch.Generator | None) -> Encoded:
        scale, peak = v.abs().sum() / len(v), v.abs().max()
        if scale.isinf() and peak.isfinite():  # the sum overflowed, not the mean: sum in units of the peak
            scale = (v.abs() / peak).sum() / len(v) * peak
        fields = (float_field("scale", scale.reshape(1)), uint_field("signs", (v < 0).to(torch.uint8), 1))
        return Encoded(fields, len(v), v.dtype)

    def decode(self, e: Encoded) -> torch.Tensor:
        scale = field_floats(e["scale"], e.dtype)
        return scale * (1.0 - 2.0 * torch.from_numpy(e["signs"].astype("float64")).to(e.dtype))


@COMPRESSORS.register("int8")
@dataclass
class Int8(Compressor):
    """8-bit stochastic quantization: 256 evenly spaced levels from the vector's minimum to its maximum, each
    value rounded stochastically to a neighbouring level (unbiased; Suresh et al. 2017's stochastic k-level
    quantization with k = 256). On the wire: minimum and maximum at the float width and 8 bits per value."""

    error_feedback: bool = False
    random: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True
    LEVELS: ClassVar[int] = 255  # intervals between the 256 levels

    def encode(self, v: torch.Tensor, rng: torch.Generator | None) -> Encoded:
        lo, hi = v.min(), v.max()
        u = torch.rand(len(v), generator=rng, dtype=v.dtype)
        step = (hi - lo) / self.LEVELS
        if self._range_overflows(lo, hi):  # the range, not a value, left the float range: in halves (exact)
            t = (v / 2 - lo / 2) / ((hi / 2 - lo / 2) / self.LEVELS)
        else:
            t = (v - lo) / step if step > 0 else torch.zeros_like(v)
        low = t.floor()
        code = (low + (u < t - low).to(v.dtype)).clamp(0, self.LEVELS)
        fields = (float_field("bounds", torch.stack([lo, hi])), uint_field("codes", code.to(torch.int64), 8))
        return Encoded(fields, len(v), v.dtype)

    def decode(self, e: Encoded) -> torch.Tensor:
        lo, hi = field_floats(e["bounds"], e.dtype)
        code = torch.from_numpy(e["codes"].astype("float64")).to(e.dtype)
        if self._range_overflows(lo, hi):  # each half of the step stays in range
            half = code * ((hi / 2 - lo / 2) / self.LEVELS)
            return lo + half + half
        return lo + code * ((hi - lo) / self.LEVELS)

    @staticmethod
    def _range_overflows(lo: torch.Tensor, hi: torch.Tensor) -> bool:
        """Whether ``hi - lo`` leaves the float range though both bounds are finite (e.g. -3e38 and 3e38)."""
        return bool((hi - lo).isinf() and lo.isfinite() and hi.isfinite())


def received(
    compressor: Compressor, data: bytes, size: int, dtype: torch.dtype, rng: torch.Generator | None
) -> Encoded:
    """The message a receiver reads from ``data`` (:meth:`Encoded.to_bytes` of a vector of ``size`` values of
    ``dtype``), with what both ends regenerate (random-k's coordinates) drawn from ``rng``, the sender's stream.
    Its layout and shared part come from encoding a zero vector of that size: no compressor's layout depends on
    the values, only on the size and the options."""
    template = compressor.encode(torch.zeros(size, dtype=dtype), rng)
    return Encoded.from_bytes(data, template.layout, size, dtype, template.shared)


def wire_bits(compressor: Compressor, size: int, dtype: torch.dtype) -> int:
    """The bits of one encoded vector of ``size`` values of ``dtype`` (the formulas of docs/compression.md)."""
    f = float_bits(dtype)
    if isinstance(compressor, TopK):
        return compressor.kept(size) * (index_bits(size) + f)
    if isinstance(compressor, RandK):
        return compressor.kept(size) * f
    if isinstance(compressor, QSGD):
        return f + size * (1 + compressor.levels.bit_length())
    if isinstance(compressor, EFSign):
        return f + size
    if isinstance(compressor, Int8):
        return 2 * f + 8 * size
    raise TypeError(f"no formula for {type(compressor).__name__}")
