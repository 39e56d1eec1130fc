"""copy_tensors: the same bytes as a plain copy, whatever the split across threads."""

from __future__ import annotations

import pytest
import torch

from rlfleet.weightsync import DTYPES, checksum, copy_tensors, default_copy_threads

MiB = 1024 * 1024


def _pairs(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    srcs = [
        torch.randint(0, 255, (40 * MiB,), dtype=torch.uint8, generator=g),  # split across threads
        torch.randn(1024, 4096, generator=g).to(torch.bfloat16),
        torch.randn(512, 512, generator=g).t(),  # non-contiguous: copied whole
        torch.randint(-(2**40), 2**40, (3, 5), dtype=torch.int64, generator=g),
        torch.rand(17, generator=g) > 0.5,
        torch.randn(0, 3, generator=g),
    ]
    srcs += [torch.randn(7, 13, generator=g) for _ in range(200)]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    return dsts, srcs


@pytest.mark.parametrize("threads", [1, 2, 3, 8, None])
def test_copy_tensors_is_bit_exact(threads: int | None) -> None:
    dsts, srcs = _pairs(threads or 0)
    copy_tensors(dsts, srcs, threads)
    assert checksum({str(i): d for i, d in enumerate(dsts)}) == checksum(
        {str(i): s for i, s in enumerate(srcs)}
    )


def test_copy_tensors_every_dtype() -> None:
    srcs = [torch.zeros(3 * MiB, dtype=torch.uint8).view(dt)[:1000] for dt in DTYPES.values()]
    for s in srcs:  # raw random bytes (any bit pattern must survive), 0/1 for bool
        s.view(torch.uint8).random_(0, 2 if s.dtype == torch.bool else 256)
    dsts = [torch.empty_like(s) for s in srcs]
    copy_tensors(dsts, srcs, 4)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8))


def test_copy_tensors_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="2 destinations but 1 sources"):
        copy_tensors([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
    with pytest.raises(ValueError, match="threads must be >= 1"):
        copy_tensors([torch.zeros(1)], [torch.zeros(1)], 0)
    with pytest.raises(RuntimeError):
        copy_tensors([torch.zeros(64 * MiB // 4)], [torch.zeros(3)], 2)  # shapes do not broadcast
    assert 1 <= default_copy_threads() <= 8


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_tensors_behaves_as_copy_for_autograd_views_and_shapes(threads: int) -> None:
    big = 40 * MiB  # large enough to be split across threads
    dst, src = torch.zeros(big, dtype=torch.uint8), torch.ones(big, dtype=torch.uint8)
    before = dst._version
    copy_tensors([dst], [src], threads)
    assert dst._version > before  # autograd sees the write, as with copy_
    assert torch.equal(dst, src)

    param = torch.nn.Parameter(torch.zeros(big // 4))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        copy_tensors([param], [torch.ones(big // 4)], threads)
    with torch.no_grad():
        copy_tensors([param], [torch.ones(big // 4)], threads)
    assert bool((param == 1).all())

    with pytest.raises(RuntimeError):  # same number of elements, shapes that do not broadcast
        copy_tensors([torch.zeros(2, big // 8)], [torch.zeros(big // 8, 2)], threads)

    z = torch.randn(1000, dtype=torch.complex64)
    for view in (z.conj(), torch.randn(1000).neg()._neg_view()):  # lazy bits: logical values
        out = torch.empty_like(view.resolve_conj().resolve_neg())
        copy_tensors([out], [view], threads)
        assert torch.equal(out, view.resolve_conj().resolve_neg())
