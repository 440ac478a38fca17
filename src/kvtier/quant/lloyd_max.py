"""Lloyd-Max quantisers for a unit normal, b = 1..8 bits, computed once and cached.

For ``L = 2**b`` levels the optimal (minimum mean-squared error) scalar
quantiser of ``X ~ N(0, 1)`` satisfies two conditions at once:

- each boundary is the midpoint of its two neighbouring centroids,
  ``t_k = (c_{k-1} + c_k) / 2``;
- each centroid is the conditional mean of its cell,
  ``c_k = (phi(t_k) - phi(t_{k+1})) / (Phi(t_{k+1}) - Phi(t_k))``.

We solve them on the positive half (the quantiser is symmetric and ``L`` even)
in float64 with the exact normal density (``erfc`` for the tail masses, so the
outer cells lose no precision), starting from the companding approximation
``c_k = sqrt(3) * Phi^-1((k + 1/2) / L)`` and applying Newton's method to the
Lloyd fixed point ``c = G(c)`` (its Jacobian is tridiagonal), which converges in
a handful of steps where plain Lloyd iteration needs ~10^5 at 8 bits. The
results agree with Max (1960): b=2: +-0.4528, +-1.510; b=3: +-0.2451, +-0.7560,
+-1.344, +-2.152; distortion 0.11748, 0.034548, 0.009501 at b = 2, 3, 4 (Max's
table prints 0.1175, 0.03454, 0.009497).

A value ``v`` is coded as ``idx = sum_k [v > t_k]`` over the ``L - 1`` inner
boundaries (a value equal to a boundary takes the lower cell), decoded as
``c[idx]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class LloydMaxQuantizer:
    """The ``2**bits``-level Lloyd-Max quantiser of N(0, 1).

    ``centroids``: ``2**bits`` ascending floats (symmetric about 0);
    ``boundaries``: the ``2**bits - 1`` inner boundaries (midpoints);
    ``mse``: ``E[(X - Q(X))^2]`` for ``X ~ N(0, 1)``.
    """

    bits: int
    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]
    mse: float

    def centroids_tensor(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Centroids ``[2**bits]`` in ``dtype`` on ``device``."""
        return torch.tensor(self.centroids, dtype=torch.float64).to(device=device, dtype=dtype)

    def boundaries_tensor(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inner boundaries ``[2**bits - 1]`` in ``dtype`` on ``device``."""
        return torch.tensor(self.boundaries, dtype=torch.float64).to(device=device, dtype=dtype)


@functools.cache
def lloyd_max_quantizer(bits: int) -> LloydMaxQuantizer:
    """The Lloyd-Max quantiser of a unit normal at ``bits`` bits (1..8), cached.

    Example::

        >>> q = lloyd_max_quantizer(2)
        >>> [round(c, 3) for c in q.centroids]
        [-1.51, -0.453, 0.453, 1.51]
        >>> round(q.mse, 4)
        0.1175
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"Lloyd-Max bits must be an int in 1..8, got {bits!r}")
    half = 1 << (bits - 1)  # levels on the positive side
    p = (torch.arange(half, dtype=torch.float64) + 0.5 + half) / (2 * half)
    c = math.sqrt(3.0) * torch.special.ndtri(p)  # companding start (point density ~ pdf^(1/3))
    for _ in range(50):
        m, dm_da, dm_db = _cell_means(c)
        residual = c - m
        if residual.abs().max().item() < 1e-12:
            break
        # d m_k / d c: cell k's lower boundary (c_{k-1}+c_k)/2, upper (c_k+c_{k+1})/2
        jac = torch.eye(half, dtype=torch.float64)
        k = torch.arange(half)
        jac[k[1:], k[1:] - 1] -= dm_da[1:] / 2
        jac[k[1:], k[1:]] -= dm_da[1:] / 2
        jac[k[:-1], k[:-1]] -= dm_db[:-1] / 2
        jac[k[:-1], k[:-1] + 1] -= dm_db[:-1] / 2
        c = c - torch.linalg.solve(jac, residual)
    else:
        raise AssertionError(f"Lloyd-Max at {bits} bits did not converge")
    m, _, _ = _cell_means(c)
    t = _boundaries(c)
    mass = 0.5 * torch.special.erfc(t[:-1] / _SQRT2) - 0.5 * torch.special.erfc(t[1:] / _SQRT2)
    # E[(X - c)^2] over the cells = E[X^2] - sum P_k c_k^2 when c_k are the cell means
    mse = 1.0 - 2.0 * float((mass * m * m).sum())
    pos = [float(v) for v in m]
    centroids = tuple([-v for v in reversed(pos)] + pos)
    inner = [(centroids[i] + centroids[i + 1]) / 2 for i in range(len(centroids) - 1)]
    return LloydMaxQuantizer(bits, centroids, tuple(inner), mse)


def _boundaries(c: torch.Tensor) -> torch.Tensor:
    """Positive-half cell edges ``[0, midpoints..., inf]`` for positive centroids ``c``."""
    inf = c.new_full((1,), math.inf)
    return torch.cat([c.new_zeros(1), (c[:-1] + c[1:]) / 2, inf])


def _cell_means(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conditional means of N(0,1) on the cells of ``c`` and their derivatives by the
    lower (``a``) and upper (``b``) edges: ``dm/da = phi(a)(m - a)/P``, ``dm/db = phi(b)(b - m)/P``."""
    t = _boundaries(c)
    tail = 0.5 * torch.special.erfc(t / _SQRT2)  # P(X > t)
    phi = _INV_SQRT_2PI * torch.exp(-0.5 * t * t)
    mass = tail[:-1] - tail[1:]
    m = (phi[:-1] - phi[1:]) / mass
    upper = torch.where(torch.isinf(t[1:]), torch.zeros_like(m), t[1:])
    return m, phi[:-1] * (m - t[:-1]) / mass, phi[1:] * (upper - m) / mass
