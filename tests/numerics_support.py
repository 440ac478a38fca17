"""What the elementwise kernel tests share: comparing floats within units in the last place."""

from __future__ import annotations

import torch


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, scale: torch.Tensor | None = None) -> None:
    """Each element within ``ulps`` units in the last place (of ``want``'s dtype) of ``scale``
    (default ``|want|``): a product may be contracted into a fused multiply-add, a sum taken in
    another order."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs() if scale is None else scale
    ulp = torch.finfo(want.dtype).eps * scale.clamp_min(torch.finfo(want.dtype).tiny)
    bad = (got.float() - want.float()).abs() > ulps * ulp + torch.finfo(want.dtype).tiny
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements differ by more than {ulps} ulp"
