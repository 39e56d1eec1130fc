"""Offload/reload of params, grads, buffers and optimizer state: memory freed, bytes restored exactly."""

from __future__ import annotations

import pytest
import torch

from rlfleet.weightsync import (
    Layout,
    SharedBuffer,
    SharedBufferReader,
    checksum,
    is_offloaded,
    offload_module,
    offload_optimizer,
    reload_module,
    reload_optimizer,
)

DEVICE = "cpu"  # the same calls move CUDA storages to pinned host memory on a GPU machine


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied weights: one storage, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(x))))


def _train_step(net: Net, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(net(x), x)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _grads(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


def _state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}": v
        for i, state in enumerate(opt.state.values())
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def test_module_offload_frees_storage_and_reload_is_bit_exact() -> None:
    torch.manual_seed(0)
    net = Net().to(DEVICE)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _train_step(net, opt, 1)
    _train_step(net, opt, 2)  # grads left in place on purpose
    alias = net.state_dict()  # detached aliases taken before offload
    params, grads, buffers = (
        checksum(net.state_dict()),
        checksum(_grads(net)),
        checksum(dict(net.named_buffers())),
    )
    weight = net.body.weight
    stats = offload_module(net, "cpu")
    assert is_offloaded(net)
    assert stats.nbytes > 0
    assert weight.untyped_storage().nbytes() == 0, "device storage released"
    assert net.body.weight.grad is not None
    assert net.body.weight.grad.untyped_storage().nbytes() == 0
    assert offload_module(net).nbytes == 0, "a second offload is a no-op"
    back = reload_module(net)
    assert back.nbytes == stats.nbytes
    assert not is_offloaded(net)
    assert net.body.weight is weight, "the same Parameter objects (the optimizer's) come back"
    assert checksum(net.state_dict()) == params
    assert checksum(_grads(net)) == grads
    assert checksum(dict(net.named_buffers())) == buffers
    assert checksum(alias) == params, "aliases stay valid: the same storages were refilled"
    assert net.head.weight.data_ptr() == net.embed.weight.data_ptr()
    assert reload_module(net).nbytes == 0


def test_optimizer_offload_round_trip_trains_identically() -> None:
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    for seed in (1, 2):
        _train_step(a, opt_a, seed)
        _train_step(b, opt_b, seed)
    state = checksum(_state_tensors(opt_b))
    stats = offload_optimizer(opt_b, "cpu")
    assert stats.storages == len(_state_tensors(opt_b))
    assert all(t.untyped_storage().nbytes() == 0 for t in _state_tensors(opt_b).values())
    offload_module(b, grads=True)
    reload_module(b)
    reload_optimizer(opt_b)
    assert checksum(_state_tensors(opt_b)) == state
    for seed in (3, 4):
        _train_step(a, opt_a, seed)
        _train_step(b, opt_b, seed)
    assert checksum(a.state_dict()) == checksum(b.state_dict())


def test_shared_memory_weights_are_skipped_not_copied() -> None:
    net = torch.nn.Linear(8, 8)
    layout = Layout.from_state_dict(net.state_dict())
    with SharedBuffer(layout, 1) as shared, SharedBufferReader.attach(shared.name) as reader:
        shared.publish(net.state_dict(), 1)
        reader.bind_module(net)
        reader.refresh()
        stats = offload_module(net)
        assert stats.storages == 0
        assert stats.skipped == 1, "weights viewed from one shared segment: nothing private to free"
        reload_module(net)
        assert checksum(net.state_dict()) == checksum(reader.tensors())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_offload_to_pinned_host_memory() -> None:  # pragma: no cover - GPU only
    """On a GPU: storages go to pinned host memory and their device memory is freed; with
    `empty_cache` it also leaves torch's cache (a colocated process can allocate it); reload
    is bit-exact."""
    net = torch.nn.Linear(4096, 4096).cuda()  # a 64 MiB weight: a cache segment of its own
    before = checksum(net.state_dict())
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    stats = offload_module(net, empty_cache=True)
    assert torch.cuda.memory_allocated() <= allocated - stats.nbytes
    assert reserved - torch.cuda.memory_reserved() >= net.weight.numel() * 4, (
        "the weight's segment left the cache"
    )
    reload_module(net)
    assert checksum(net.state_dict()) == before


@pytest.mark.gpu
@pytest.mark.parametrize("index", [0, 1])
def test_offload_waits_for_writes_queued_on_any_stream_of_any_device(index: int) -> None:
    """On a GPU (and on a second one): a parameter written on a side stream of its device,
    behind a GPU spin, just before the offload comes back with that write, while cuda:0 is
    the current device. Offload synchronizes every device it copies from, all streams (the old
    code copied on the current stream at once and synchronized the current device only)."""
    if torch.cuda.device_count() <= index:
        pytest.skip(f"needs {index + 1} CUDA device(s)")
    torch.cuda.set_device(0)
    device = torch.device("cuda", index)
    net = Net().to(device)
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)  # type: ignore[no-untyped-call]
        net.body.weight.data.fill_(0.25)
    offload_module(net)
    reload_module(net)
    assert bool((net.body.weight == 0.25).all())
