"""The simulated CUDA device for tensors (``lightmem.testing.cuda_tensor``): tensors that report
``cuda:0``, keep CPU values, and raise CUDA's error where a GPU would (issue 49, item 2)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorDeviceMismatchError, FakeTensorMode

from lightmem.testing.cuda_tensor import (
    CUDA_DEVICE,
    NUMPY_ERROR,
    SAME_DEVICE_ERROR,
    SimulatedCudaTensor,
    simulated_cuda,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _on_simulated_cuda():
    with simulated_cuda():
        yield


def _on_cuda(tensor: torch.Tensor) -> bool:
    return type(tensor) is SimulatedCudaTensor and tensor.device == CUDA_DEVICE and tensor.is_cuda and not tensor.is_cpu


def test_a_tensor_moved_to_cuda_reports_cuda_and_keeps_its_values_in_cpu_memory():
    values = torch.arange(6.0).reshape(2, 3)
    moved = values.to("cuda")
    assert _on_cuda(moved) and moved.get_device() == 0
    assert moved.untyped_storage().device == CPU  # where the values really are
    assert moved.data_ptr() != values.data_ptr()  # a move to another device copies
    assert torch.equal(moved.cpu(), values)
    assert repr(moved[0]) == "SimulatedCudaTensor([0., 1., 2.], device='cuda:0')"


@pytest.mark.parametrize(
    "mix",
    [
        lambda x, cpu: x + cpu,
        lambda x, cpu: cpu * x,
        lambda x, cpu: cpu.add_(x),
        lambda x, cpu: x.sub_(cpu),
        lambda x, cpu: torch.count_nonzero(x, dim=0) + cpu.long(),
        lambda x, cpu: torch.where(x > 0, x, cpu),
        lambda x, cpu: x @ cpu,
        lambda x, cpu: torch.cat([x, cpu]),
    ],
    ids=["add", "mul", "cpu add_", "sub_", "counts", "where", "matmul", "cat"],
)
def test_an_op_mixing_it_with_a_cpu_tensor_raises_cudas_error(mix):
    x = torch.ones(3, 3, device="cuda")
    with pytest.raises(RuntimeError) as error:
        mix(x, torch.ones(3, 3))
    assert str(error.value) == SAME_DEVICE_ERROR
    assert SAME_DEVICE_ERROR == (
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
    )


def test_an_in_place_op_of_a_cpu_tensor_mixing_it_raises_cudas_error_as_counts_plus_equals_did():
    # lightmem.estimate.trace.batch._sparse_input on the H200: counts made on the CPU, the batch on CUDA.
    counts = torch.zeros(4, dtype=torch.int64)
    rows = torch.ones(4, 8, device="cuda")
    with pytest.raises(RuntimeError) as error:
        counts += torch.count_nonzero(rows, dim=1)
    assert str(error.value) == SAME_DEVICE_ERROR


def test_a_0_dim_cpu_tensor_is_an_input_cuda_takes_but_not_an_output():
    x = torch.full((3,), 2.0, device="cuda")
    scale = torch.tensor(3.0)
    assert _on_cuda(x * scale) and (x * scale).tolist() == [6.0, 6.0, 6.0]
    assert _on_cuda(torch.where(x > 1, x, scale))
    with pytest.raises(RuntimeError) as error:
        scale.add_(x.sum())
    assert str(error.value) == SAME_DEVICE_ERROR
    with pytest.raises(RuntimeError) as error:
        torch.mul(x.sum(), 2.0, out=torch.zeros(()))
    assert str(error.value) == SAME_DEVICE_ERROR


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_copies_and_indexing_take_cpu_tensors_as_cuda_does():
    x = torch.zeros(4, device="cuda")
    x.copy_(torch.arange(4.0))
    x[torch.tensor([0, 1])] = torch.tensor([5.0, 6.0])
    assert _on_cuda(x[torch.tensor([0, 3])]) and x[torch.tensor([0, 3])].tolist() == [5.0, 3.0]
    host = torch.empty(4)
    host.copy_(x)
    assert type(host) is torch.Tensor and host.tolist() == [5.0, 6.0, 2.0, 3.0]
    assert _on_cuda(x.new_tensor(torch.ones(2)))


def test_numpy_of_it_raises_cudas_error():
    with pytest.raises(TypeError) as error:
        torch.ones(2, device="cuda").numpy()
    assert str(error.value) == NUMPY_ERROR


FACTORIES = {
    "zeros": lambda device: torch.zeros(2, 3, device=device),
    "ones": lambda device: torch.ones(2, 3, dtype=torch.int64, device=device),
    "empty": lambda device: torch.empty(2, 3, device=device),
    "empty_strided": lambda device: torch.empty_strided((2, 3), (1, 2), device=device),
    "full": lambda device: torch.full((2, 3), 7.0, device=device),
    "arange": lambda device: torch.arange(6, device=device),
    "linspace": lambda device: torch.linspace(0, 1, 5, device=device),
    "tensor": lambda device: torch.tensor([[1, 2], [3, 4]], device=device),
    "as_tensor": lambda device: torch.as_tensor([1.0, 2.0], device=device),
    "eye": lambda device: torch.eye(3, device=device),
    "rand": lambda device: torch.rand(2, 3, device=device),
    "randn": lambda device: torch.randn(2, 3, device=device),
    "randint": lambda device: torch.randint(0, 9, (2, 3), device=device),
    "randperm": lambda device: torch.randperm(5, device=device),
    "zeros_like": lambda device: torch.zeros_like(torch.ones(2), device=device),
    "full_like": lambda device: torch.full_like(torch.ones(2), 3.0, device=device),
    "randn_like": lambda device: torch.randn_like(torch.ones(2), device=device),
    "new_zeros": lambda device: torch.ones(2).new_zeros(3, device=device),
}


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("device", ["cuda", "cuda:0", CUDA_DEVICE, 0])
def test_a_factory_asked_for_cuda_makes_a_simulated_cuda_tensor(name, device):
    made = FACTORIES[name](device)
    assert _on_cuda(made)
    if name not in ("empty", "empty_strided", "rand", "randn", "randint", "randperm", "randn_like"):
        assert torch.equal(made.cpu(), FACTORIES[name]("cpu"))


def test_factories_and_likes_of_a_cuda_tensor_stay_on_cuda_unless_told_otherwise():
    x = torch.ones(2, 2, device="cuda")
    assert _on_cuda(torch.zeros_like(x)) and _on_cuda(x.new_empty(3)) and _on_cuda(torch.empty_like(x))
    assert type(torch.zeros_like(x, device="cpu")) is torch.Tensor
    assert type(x.new_zeros(3, device="cpu")) is torch.Tensor
    assert type(torch.zeros(2)) is torch.Tensor and type(torch.zeros(2, device="cpu")) is torch.Tensor


def test_to_and_cuda_move_onto_it_and_cpu_and_to_cpu_move_back_as_copies():
    host = torch.arange(4.0)
    for moved in (host.to("cuda"), host.cuda(), host.to(device="cuda:0"), host.to(torch.ones(1, device="cuda"))):
        assert _on_cuda(moved) and moved.data_ptr() != host.data_ptr() and torch.equal(moved.cpu(), host)
    on_cuda = host.cuda()
    assert on_cuda.to("cuda") is on_cuda and on_cuda.cuda() is on_cuda
    half = on_cuda.to(torch.float16)
    assert _on_cuda(half) and half.dtype == torch.float16
    for back in (on_cuda.cpu(), on_cuda.to("cpu"), on_cuda.to(host)):
        assert type(back) is torch.Tensor and back.device == CPU and back.data_ptr() != on_cuda.data_ptr()
        back.add_(1)
    assert on_cuda.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]  # the copies were written, not the device tensor


def test_what_ops_and_autograd_make_from_it_stays_on_it():
    weight = torch.randn(3, 3, device="cuda", requires_grad=True)
    x = torch.randn(2, 3, device="cuda")
    hidden = (x @ weight).relu()
    total, index = hidden.max(dim=1)
    assert all(_on_cuda(t) for t in (hidden, total, index, hidden.sum(), hidden.view(-1), hidden.T, hidden[0]))
    total.sum().backward()
    assert _on_cuda(weight.grad)
    expected_weight = weight.detach().cpu().requires_grad_()
    (x.cpu() @ expected_weight).relu().max(dim=1).values.sum().backward()
    assert torch.equal(weight.grad.cpu(), expected_weight.grad)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("temperature", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) / self.temperature


def test_module_to_cuda_moves_parameters_and_buffers_and_keeps_each_parameter_for_its_optimizer():
    torch.manual_seed(0)
    model = _Scaled()
    reference = copy.deepcopy(model)
    weight = model.linear.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.to("cuda")
    assert model.linear.weight is weight and isinstance(weight, nn.Parameter) and _on_cuda(weight)
    assert [name for name, _ in model.named_parameters()] == ["linear.weight", "linear.bias"]
    assert _on_cuda(model.temperature)
    model(torch.ones(4, 3, device="cuda")).sum().backward()
    optimizer.step()
    assert _on_cuda(weight.grad) and _on_cuda(optimizer.state[weight]["exp_avg"])
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    reference(torch.ones(4, 3)).sum().backward()
    reference_optimizer.step()
    assert torch.equal(weight.cpu(), reference.linear.weight.detach())
    with pytest.raises(RuntimeError) as error:
        model(torch.ones(4, 3))  # a batch left on the CPU
    assert str(error.value) == SAME_DEVICE_ERROR
    model.cpu()
    assert model.linear.weight is weight and type(weight) is nn.Parameter and weight.device == CPU
    assert type(weight.grad) is torch.Tensor and type(model.temperature) is torch.Tensor


def test_a_parameter_made_from_it_and_a_deep_copy_of_it_are_on_it():
    parameter = nn.Parameter(torch.zeros(2, device="cuda"))
    assert _on_cuda(parameter) and isinstance(parameter, nn.Parameter) and parameter.requires_grad
    copied = copy.deepcopy(nn.Linear(2, 2).cuda())
    assert _on_cuda(copied.weight) and isinstance(copied.weight, nn.Parameter)


def test_under_fake_tensor_mode_it_is_a_fake_on_cuda_as_a_cuda_tensor_is():
    x = torch.ones(4, device="cuda")
    with FakeTensorMode(allow_non_fake_inputs=True):
        doubled = x * 2
        assert type(doubled) is FakeTensor and doubled.device == CUDA_DEVICE
        made = torch.zeros(4, device="cuda")  # FakeTensorMode keeps CUDA devices itself
        assert type(made) is FakeTensor and made.device == CUDA_DEVICE
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.zeros(4)  # a fake on the CPU
    mode = FakeTensorMode()
    fake = mode.fake_tensor_converter.from_real_tensor(mode, torch.tensor(2.0, device="cuda"), make_constant=True)
    assert fake.device == CUDA_DEVICE  # as a CUDA buffer's fake keeps its device



def test_the_example_of_simulated_cuda_runs():
    import doctest

    from lightmem.testing import cuda_tensor

    result = doctest.testmod(cuda_tensor)
    assert result.attempted > 0 and result.failed == 0


def test_what_autograd_saves_and_passes_back_reports_cuda_too():
    weight = torch.randn(3, 3, device="cuda", requires_grad=True)
    x = torch.randn(2, 3, device="cuda")
    packed, passed_back = [], []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.device)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden = nn.functional.linear(x, weight).relu()  # relu saves its own output
    hidden.register_hook(lambda grad: passed_back.append(grad.device))
    hidden.sum().backward()
    assert packed == [CUDA_DEVICE] * 2 and passed_back == [CUDA_DEVICE]


class _Masked(nn.Module):
    """Builds a mask on its input's device, as attention does: in a checkpointed block that runs
    again in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[-1], x.shape[-1], device=x.device).tril()
        return self.linear(x).relu() @ mask


def test_a_checkpointed_block_builds_its_tensors_on_cuda_when_backward_runs_it_again():
    torch.manual_seed(0)
    block = _Masked()
    reference = copy.deepcopy(block)
    block.cuda()
    x = torch.randn(3, 4, device="cuda")
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    out.sum().backward()  # the recompute would fail on CUDA metadata, or on a CPU-only build's factory
    reference(x.cpu()).sum().backward()
    assert _on_cuda(block.linear.weight.grad)
    assert torch.equal(block.linear.weight.grad.cpu(), reference.linear.weight.grad)
