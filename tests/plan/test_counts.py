"""The model's work counts against independent counts on tiny models: forward FLOPs against
torch's FlopCounterMode, factor and second-order bytes against what the real K-FAC
preconditioner allocates, parameters against the model. (Memory per rank is memory.py's:
tests/plan/test_memory.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kfac_hpc import KFACPreconditioner
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.layers import INPUTS, model_shape
from kfac_hpc.plan.model import CostModel, PlanConfig
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.workloads import build_model
from tests.helpers.models import profiled_gemm_flops
from tests.plan.rank_work import rank_work, spread


@pytest.mark.parametrize(
    ("model", "dataset"), [("small_cnn", "digits"), ("mlp", "digits"), ("resnet20", "cifar10")]
)
def test_forward_flops_match_torch_flop_counter(model: str, dataset: str) -> None:
    shape = model_shape(model, dataset)
    in_shape, classes = INPUTS[dataset]
    net = build_model(TrainConfig(model=model), in_shape, classes).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        net(torch.zeros(3, *in_shape))
    assert 3 * shape.forward_flops == counter.get_total_flops()
    assert shape.params == sum(p.numel() for p in net.parameters())


def _trained_preconditioner(model: str, dataset: str) -> KFACPreconditioner:
    in_shape, classes = INPUTS[dataset]
    torch.manual_seed(0)
    net = build_model(TrainConfig(model=model), in_shape, classes)
    pre = KFACPreconditioner(net)
    x, y = torch.randn(4, *in_shape), torch.randint(0, classes, (4,))
    torch.nn.functional.cross_entropy(net(x), y).backward()
    pre.step()
    return pre


@pytest.mark.parametrize(("model", "dataset"), [("small_cnn", "digits"), ("resnet20", "cifar10")])
def test_factor_and_second_order_bytes_match_the_preconditioner(model: str, dataset: str) -> None:
    shape = model_shape(model, dataset)
    pre = _trained_preconditioner(model, dataset)
    held = pre.memory_usage()
    assert sum(layer.factor_elements for layer in shape.layers) * 4 == held["factors_bytes"]
    # one rank = comm-opt: it holds QA, dA, QG, dG and the eigenvalue outer product of all
    # layers; the model counts Q's and the outer product (the eigenvalue vectors are O(n))
    vectors = sum(layer.n_a + layer.n_g for layer in shape.layers) * 4
    second = (
        sum((layer.n_a**2 + layer.n_g**2 + layer.n_a * layer.n_g) for layer in shape.layers) * 4
    )
    assert second + vectors == held["second_order_bytes"]
    assert [(layer.n_a, layer.n_g) for layer in shape.layers] == [
        tuple(pre.factors[layer.name].A.shape[-1:] + pre.factors[layer.name].G.shape[-1:])  # type: ignore[union-attr]
        for layer in shape.layers
    ]


def test_rated_compute_divides_counted_work_by_the_rates() -> None:
    shape = model_shape("small_cnn", "digits")
    machine = MachineProfile("t", 1e9, 1e8, 1e10, 1e12, kernel_overhead_s=0.0)
    compute = RatedCompute(machine, shape)
    forward, backward = compute.forward_backward_s(8)
    assert forward == pytest.approx(
        8 * shape.forward_flops / 1e9 + 8 * shape.activations_per_sample * 8 / 1e10
    )
    assert backward == pytest.approx(2 * forward)
    assert compute.eigh_s(100) == pytest.approx(9 * 100**3 / 1e8)
    layer = shape.layers[0]
    assert compute.factor_s(layer, 8) == pytest.approx(8 * layer.factor_flops / 1e9)


def test_strategies_differ_where_kaisa_says() -> None:
    """At P = 8: comm-opt broadcasts second-order data and no gradients; mem-opt the
    reverse; hybrid-opt both, to groups of 4 and 2."""
    shape = model_shape("small_cnn", "digits")
    machine = MachineProfile("t", 1e12, 1e11, 1e11, 1e12)
    link = AlphaBeta(1e-5, 1e-10)
    net = NetworkProfile("t", 8, link, link, backend="gloo")
    model = CostModel(shape, RatedCompute(machine, shape), net)
    pred = {
        m: model.predict(PlanConfig(m, 8, 64, "strong", 1, 1))
        for m in ("sgd", "kfac-comm-opt", "kfac-hybrid-opt", "kfac-mem-opt")
    }
    assert pred["sgd"].phases_s["factor_comm"] == 0 and pred["sgd"].phases_s["inverse_comm"] == 0
    assert pred["kfac-comm-opt"].phases_s["grad_broadcast"] == 0
    assert pred["kfac-comm-opt"].phases_s["inverse_comm"] > 0
    assert pred["kfac-mem-opt"].phases_s["inverse_comm"] == 0
    assert pred["kfac-mem-opt"].phases_s["grad_broadcast"] > 0
    hybrid = pred["kfac-hybrid-opt"].phases_s
    assert hybrid["inverse_comm"] > 0 and hybrid["grad_broadcast"] > 0
    # grad_broadcast of mem-opt: each layer's gradient, gloo's binomial tree over 8 ranks (3
    # rounds), + the wait of the ranks done early for the busiest rank's eigendecompositions and
    # preconditioning (no inverse broadcast comes between them under mem-opt)
    expected = sum(3 * (1e-5 + layer.grad_elements * 4 * 1e-10) for layer in shape.layers)
    eigh, precondition = rank_work(model, PlanConfig("kfac-mem-opt", 8, 64, "strong", 1, 1))
    expected += spread(eigh) + spread(precondition)
    assert pred["kfac-mem-opt"].phases_s["grad_broadcast"] == pytest.approx(expected)
    # memory: comm-opt holds all second-order data, mem-opt an eighth of it
    assert pred["kfac-comm-opt"].memory_bytes > pred["kfac-mem-opt"].memory_bytes
    # factors are allreduced over all ranks whatever the strategy
    assert len({round(p.phases_s["factor_comm"], 12) for k, p in pred.items() if k != "sgd"}) == 1


def test_factor_flops_match_the_gemms_of_the_real_factor_code() -> None:
    """Each layer's factor FLOPs (from the probe's input shapes) times the batch equal the GEMM
    FLOPs the profiler records when the real layers compute A and G from captured tensors."""
    shape = model_shape("resnet20", "cifar10")
    in_shape, classes = INPUTS["cifar10"]
    torch.manual_seed(0)
    net = build_model(TrainConfig(model="resnet20"), in_shape, classes)
    pre = KFACPreconditioner(net, update_factors_in_hook=False)
    torch.nn.functional.cross_entropy(net(torch.randn(3, *in_shape)), torch.arange(3)).backward()
    captured = {name: (s.inputs[0], s.grads[0]) for name, s in pre.states.items()}

    def factor_pass() -> None:
        for name, layer in pre.layers.items():
            x, g = captured[name]
            layer.a_factor(x, torch.float32)
            layer.g_factor(g, 1.0, torch.float32)

    assert [layer.name for layer in shape.layers] == list(pre.layers)
    assert 3 * sum(layer.factor_flops for layer in shape.layers) == profiled_gemm_flops(factor_pass)
