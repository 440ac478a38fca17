"""Seeded randomized Hadamard rotation: ``Pi = H_d . diag(s) / sqrt(d)``.

``H_d`` is the Sylvester Hadamard matrix (``H_1 = [1]``,
``H_2n = [[H_n, H_n], [H_n, -H_n]]``, so ``H[i, j] = (-1)^popcount(i & j)``);
``s`` is a vector of random signs drawn on the CPU as::

    bits = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed))
    s = 2 * bits - 1

``Pi`` is orthogonal (``Pi^T Pi = I``). :meth:`HadamardRotation.apply` computes
``y = Pi x`` on the last dimension with a fast Walsh-Hadamard transform
(``log2 d`` butterfly stages, ``O(d log d)``); :meth:`HadamardRotation.inverse`
computes ``x = Pi^T y = s * (H_d y) / sqrt(d)``. Kernels that prefer a matmul
take :meth:`HadamardRotation.matrix`: ``y = x @ Pi.T`` for row vectors ``x``.
"""

from __future__ import annotations

import math

import torch

from kvtier.quant.codec import CodecUnsupported

MIN_DIM, MAX_DIM = 64, 512


def check_rotation_dim(dim: int, what: str = "HadamardRotation") -> None:
    """Raise :class:`CodecUnsupported` unless ``dim`` is a power of two in 64..512."""
    ok = isinstance(dim, int) and not isinstance(dim, bool) and MIN_DIM <= dim <= MAX_DIM
    if not ok or dim & (dim - 1):
        raise CodecUnsupported(
            f"{what} needs head_dim a power of two in {MIN_DIM}..{MAX_DIM}, got {dim!r}"
        )


class HadamardRotation:
    """The orthogonal map ``Pi = H_d . diag(s) / sqrt(d)`` on vectors of size ``dim``.

    ``dim`` is a power of two from 64 to 512 (else :class:`CodecUnsupported`);
    ``seed`` fixes the signs ``s`` (``signs``, int8 ``[dim]``, on the CPU).

    Example::

        >>> rot = HadamardRotation(128, seed=0)
        >>> x = torch.randn(4, 8, 128)
        >>> y = rot.apply(x)                  # (4, 8, 128), same norms as x
        >>> torch.allclose(rot.inverse(y), x, atol=1e-5)
        True
    """

    def __init__(self, dim: int, seed: int = 0):
        check_rotation_dim(dim)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.dim = dim
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.signs = (2 * torch.randint(0, 2, (dim,), generator=gen) - 1).to(torch.int8)
        self._signs_cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``y = Pi x`` over the last dim of ``x`` ``[..., dim]``.

        Computed in float32 (float64 stays float64) and returned in ``x.dtype``.
        """
        xf = self._working(x)
        return _fwht(xf * self._scaled_signs(xf)).to(x.dtype)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``x = Pi^T y = s * (H_d y) / sqrt(d)`` over the last dim of ``y`` ``[..., dim]``."""
        yf = self._working(y)
        return _fwht(yf).mul_(self._scaled_signs(yf)).to(y.dtype)

    def scaled_signs(self) -> torch.Tensor:
        """``s / sqrt(d)`` float32 ``[dim]`` on the CPU: what :meth:`apply` multiplies ``x`` by
        before the transform, and :meth:`inverse` the transform's output after it (cached)."""
        return self._scaled_signs(torch.empty(0))

    def matrix(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        """Dense ``Pi`` ``[dim, dim]``: ``Pi[i, j] = H[i, j] * s[j] / sqrt(dim)``; ``y = x @ Pi.T``."""
        idx = torch.arange(self.dim)
        popcount = torch.zeros(self.dim, self.dim, dtype=torch.int64)
        both = idx[:, None] & idx[None, :]
        for bit in range(self.dim.bit_length()):
            popcount += (both >> bit) & 1
        h = 1.0 - 2.0 * (popcount & 1).to(torch.float64)  # Sylvester: (-1)^popcount(i & j)
        pi = h * self.signs.to(torch.float64)[None, :] / math.sqrt(self.dim)
        return pi.to(dtype=dtype, device=device)

    # -- internals --------------------------------------------------------------------
    def _working(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"HadamardRotation needs a floating tensor, got {x!r:.60}")
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(
                f"HadamardRotation({self.dim}): last dim of {tuple(x.shape)} must be {self.dim}"
            )
        return x if x.dtype == torch.float64 else x.to(torch.float32)

    def _scaled_signs(self, like: torch.Tensor) -> torch.Tensor:
        """``s / sqrt(d)`` in ``like``'s dtype and device (cached)."""
        key = (like.dtype, like.device)
        if key not in self._signs_cache:
            scaled = self.signs.to(torch.float64) / math.sqrt(self.dim)
            self._signs_cache[key] = scaled.to(dtype=like.dtype, device=like.device)
        return self._signs_cache[key]

    def __repr__(self) -> str:
        return f"HadamardRotation(dim={self.dim}, seed={self.seed})"


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform ``H_d x`` (Sylvester order) on the last dim.

    ``log2 d`` butterfly stages ``(a, b) -> (a + b, a - b)`` on pairs ``h`` apart,
    written alternately into two buffers; ``x`` is not modified.
    """
    d = x.shape[-1]
    m = x.numel() // d
    src = x.reshape(m, d)  # (M, d)
    bufs = [torch.empty_like(src), None]
    h, k = 1, 0
    while h < d:
        if bufs[k] is None:
            bufs[k] = torch.empty_like(src)
        s = src.view(m, d // (2 * h), 2, h)  # (M, d/2h, 2, h)
        o = bufs[k].view(m, d // (2 * h), 2, h)
        torch.add(s[:, :, 0], s[:, :, 1], out=o[:, :, 0])
        torch.sub(s[:, :, 0], s[:, :, 1], out=o[:, :, 1])
        src, k, h = bufs[k], 1 - k, 2 * h
    return src.view(x.shape)
