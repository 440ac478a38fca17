"""The packed weights moved into one mapping backed by huge pages (kvtier.model.huge_pages).

Every packed tensor ends up in one anonymous mapping the kernel was asked to back with huge
pages (its ``hg`` flag in /proc/self/smaps), with the same values: the same logits bit for bit.
Where the kernel gives no huge pages, or with ``huge_pages=False``, nothing moves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_cpu_step import small_model

from kvtier.model import huge_pages
from kvtier.model.packed import PackedLinear, load_kernels, pack_model


@pytest.fixture(autouse=True)
def _needs_kernels():
    if load_kernels() is None:
        pytest.skip("no C compiler here: nothing is packed")


def packed_tensors(model):
    return [p for m in model.modules() if isinstance(m, PackedLinear) for p in (m.codes, m.d, m.m)
            if p is not None]


def mapping_of(address: int) -> tuple[int, int, list[str]]:
    """(start, end, VmFlags) of the mapping of this process that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head and int(head[1], 16) <= address < int(head[2], 16):
            flags = next(x for x in lines[i + 1:] if x.startswith("VmFlags:"))
            return int(head[1], 16), int(head[2], 16), flags.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def logits(model):
    with torch.inference_mode():
        return model(torch.tensor([[1, 5, 9, 2]]), model.make_caches())


def unplaced_small_model(monkeypatch):
    """small_model's packed model with its tensors where packing left them."""
    from kvtier.model import packed

    with monkeypatch.context() as m:
        m.setattr(packed, "place_on_huge_pages", lambda model: 0)
        return small_model()


def test_the_packed_tensors_share_one_mapping_marked_for_huge_pages(monkeypatch):
    if huge_pages.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {huge_pages.thp_mode()!r} here")
    model = unplaced_small_model(monkeypatch)
    before = logits(model)
    values = [p.detach().clone() for p in packed_tensors(model)]
    moved = huge_pages.place_on_huge_pages(model)
    tensors = packed_tensors(model)
    assert moved >= sum(p.numel() * p.element_size() for p in tensors)
    assert len({mapping_of(p.data_ptr())[:2] for p in tensors}) == 1
    assert "hg" in mapping_of(tensors[0].data_ptr())[2]  # madvise(MADV_HUGEPAGE)
    assert min(p.data_ptr() for p in tensors) % huge_pages.HUGE_PAGE == 0
    assert all(torch.equal(a, b) for a, b in zip(values, tensors))
    assert torch.equal(logits(model), before)
    # and pack_model does it by default, saying how many bytes
    placed = small_model()
    assert len({mapping_of(p.data_ptr())[:2] for p in packed_tensors(placed)}) == 1
    assert torch.equal(logits(placed), before)


def test_pack_model_says_what_it_placed(monkeypatch):
    """``huge_pages`` in pack_model's counts: the bytes placed (each tensor on a cache line), 0
    with ``huge_pages=False`` or when nothing packs."""
    import test_cpu_step

    seen = []

    def recording(model, **kw):
        seen.append((pack_model(model, **kw), model))
        return seen[-1][0]

    monkeypatch.setattr(test_cpu_step, "pack_model", recording)
    small_model()
    stats, model = seen[-1]
    want = sum(-(-p.numel() * p.element_size() // 64) * 64 for p in packed_tensors(model))
    assert stats["huge_pages"] == (want if huge_pages.thp_mode() in ("always", "madvise") else 0)
    monkeypatch.setattr(test_cpu_step, "pack_model", lambda model: recording(model, huge_pages=False))
    small_model()
    assert seen[-1][0]["huge_pages"] == 0
    assert pack_model(small_model(packed=False))["huge_pages"] == 0  # random weights: nothing packs


def test_nothing_moves_where_the_kernel_gives_no_huge_pages(monkeypatch):
    model = unplaced_small_model(monkeypatch)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    where = [p.data_ptr() for p in packed_tensors(model)]
    assert huge_pages.place_on_huge_pages(model) == 0
    assert [p.data_ptr() for p in packed_tensors(model)] == where
    assert huge_pages.place_on_huge_pages(torch.nn.Linear(4, 4)) == 0  # nothing packed: nothing to do


def test_a_mapping_that_cannot_be_made_leaves_the_tensors(monkeypatch):
    """No memory for the mapping (``mmap`` raises): 0, and the model as it was."""
    if huge_pages.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {huge_pages.thp_mode()!r} here")
    model = unplaced_small_model(monkeypatch)
    where = [p.data_ptr() for p in packed_tensors(model)]

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    assert huge_pages.place_on_huge_pages(model) == 0
    assert [p.data_ptr() for p in packed_tensors(model)] == where
