"""The memory model's parts against direct counts on tiny models (parameters, optimizer state,
saved activations, K-FAC factors and second-order data, where they live), its ``[memory]``
profile table and what ``kfac-hpc plan`` shows of it."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch import nn

from kfac_hpc.cli import main
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.layers import INPUTS
from kfac_hpc.plan.memory import DeviceMemory, MemoryConfig, MemoryModel, device_memory
from kfac_hpc.plan.model import CostModel, PlanConfig
from kfac_hpc.plan.planner import build_cost_model
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.workloads import build_model

PROFILE = """
[machine]
gemm_flops_per_s = 1e13
eigh_flops_per_s = 1e11
memory_bytes_per_s = 1e12
memory_bytes = 16e9

[network]
ranks_per_node = 4

[network.intra]
latency_s = 5e-6
bandwidth_bytes_per_s = 1e11

[network.inter]
latency_s = 1e-5
bandwidth_bytes_per_s = 1e10
"""


def _factor_sizes(model: str, dataset: str) -> list[tuple[int, int]]:
    """(n_A, n_G) of every Linear and Conv2d, counted from the modules' weight shapes."""
    shape, classes = INPUTS[dataset]
    sizes = []
    for module in build_model(TrainConfig(model=model), shape, classes).modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            n_a = module.weight[0].numel() + (module.bias is not None)
            sizes.append((n_a, module.weight.shape[0]))
    return sizes


@pytest.mark.parametrize(("model", "dataset"), [("small_cnn", "digits"), ("mlp", "digits")])
def test_one_rank_holds_every_factor_and_all_second_order_data(model: str, dataset: str) -> None:
    parts = MemoryModel(model, dataset).predict(MemoryConfig("kfac-comm-opt", 1, 16)).parts
    sizes = _factor_sizes(model, dataset)
    assert parts["kfac_factors"] == sum((a * a + g * g) * 4 for a, g in sizes)
    # eigenvectors, eigenvalues and the eigenvalue outer product of A and G
    assert parts["kfac_second_order"] == sum((a * a + a + g * g + g + a * g) * 4 for a, g in sizes)


def test_mem_opt_spreads_factors_and_comm_opt_copies_them() -> None:
    memory = MemoryModel("resnet20", "cifar10")
    total = sum((a * a + g * g) * 4 for a, g in _factor_sizes("resnet20", "cifar10"))
    comm = memory.predict(MemoryConfig("kfac-comm-opt", 4, 8)).parts["kfac_factors"]
    mem = memory.predict(MemoryConfig("kfac-mem-opt", 4, 8)).parts["kfac_factors"]
    assert comm == total
    assert total / 4 <= mem < total


def test_parameters_gradients_and_optimizer_state() -> None:
    shape, classes = INPUTS["digits"]
    params = sum(
        p.numel() * 4
        for p in build_model(TrainConfig(model="small_cnn"), shape, classes).parameters()
    )
    memory = MemoryModel("small_cnn", "digits")
    sgd = memory.predict(MemoryConfig("sgd", 1, 8)).parts
    assert sgd == {"parameters": params, "gradients": params, "optimizer": params}
    adam = memory.predict(MemoryConfig("sgd", 1, 8, optimizer="adam")).parts
    assert adam["optimizer"] == 2 * params
    plain = memory.predict(MemoryConfig("sgd", 1, 8, momentum=0.0)).parts
    assert plain["optimizer"] == 0


def test_saved_activations_of_the_mlp_by_hand() -> None:
    """Flatten, Linear 64→128, ReLU, Linear 128→128, ReLU, Linear 128→10, cross-entropy:
    autograd keeps the input, both ReLU outputs (also the next Linear's inputs), the
    log-softmax, the targets and the loss's 0-dim total weight."""
    for batch in (1, 8, 33):
        saved = MemoryModel("mlp", "digits").trace(batch).saved_bytes
        assert saved == batch * (64 + 128 + 128 + 10) * 4 + batch * 8 + 4


def test_activations_and_gpu_chunks_grow_with_the_batch() -> None:
    memory = MemoryModel("resnet20", "cifar10")
    small, large = (memory.predict(MemoryConfig("sgd", 1, b)).peak_bytes for b in (8, 16))
    assert large > small
    cpu = memory.predict(MemoryConfig("kfac-comm-opt", 1, 128), DeviceMemory(1e12, cuda=False))
    gpu = memory.predict(MemoryConfig("kfac-comm-opt", 1, 128), DeviceMemory(1e12))
    # on a GPU the whole batch is unfolded at once, on a CPU in chunks of 4 MiB
    assert gpu.moments["backward"] > cpu.moments["backward"]


def test_context_and_workspace_add_to_every_point() -> None:
    memory = MemoryModel("mlp", "digits")
    cfg = MemoryConfig("sgd", 2, 8)
    bare = memory.predict(cfg, DeviceMemory(1e12)).peak_bytes
    device = memory.predict(cfg, DeviceMemory(1e12, 3e8, 2e8)).peak_bytes
    assert device == pytest.approx(bare + 5e8)


def test_memory_table_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "gpu.toml"
    path.write_text(PROFILE)
    assert device_memory(str(path)) is None
    path.write_text(PROFILE + "\n[memory]\ncapacity_bytes = 16e9\ncontext_bytes = 3e8\n")
    assert device_memory(str(path)) == DeviceMemory(16e9, 3e8, 0.0)
    path.write_text(PROFILE + "\n[memory]\ncapacity_bytes = 16e9\ncontext = 1\n")
    with pytest.raises(PlanInputError, match=r"memory\.context: unknown key"):
        device_memory(str(path))


def test_plan_marks_points_that_do_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "small.toml"
    # 40 MiB: resnet20 fits at 8 samples per GPU, not at 128
    path.write_text(PROFILE + "\n[memory]\ncapacity_bytes = 41943040\n")
    args = ["plan", "--hardware", str(path), "--model", "resnet20", "--dataset", "cifar10"]
    args += ["--scaling", "weak", "--ranks", "1", "--methods", "sgd"]
    small = CliRunner().invoke(main, [*args, "--batch-size", "8"])
    large = CliRunner().invoke(main, [*args, "--batch-size", "128"])
    assert small.exit_code == 0 and large.exit_code == 0, small.output + large.output
    assert "MiB/GPU" in small.output
    assert "does not fit" not in small.output
    assert "does not fit" in large.output
    path.write_text(PROFILE + "\n[memory]\ncapacity_bytes = -1\n")
    bad = CliRunner().invoke(main, [*args, "--batch-size", "8"])
    assert bad.exit_code == 2
    assert "memory.capacity_bytes" in bad.output


@pytest.mark.parametrize(
    ("model", "dataset"),
    [("small_cnn", "digits"), ("mlp", "mnist1d"), ("resnet20", "cifar10"), ("cnn1d", "mnist1d")],
)
def test_every_method_is_predicted_on_cpu_and_gpu_paths(model: str, dataset: str) -> None:
    memory = MemoryModel(model, dataset)
    for method in ("sgd", "kfac-comm-opt", "kfac-hybrid-opt", "kfac-mem-opt", "fosi"):
        for device in (None, DeviceMemory(1e12)):
            step = memory.predict(MemoryConfig(method, 4, 8), device)
            held = sum(step.parts.values())
            assert 0 < held <= step.peak_bytes < 1e12, (method, step.moments)


def test_kfac_state_per_rank_follows_where_factors_live() -> None:
    """COMM-OPT: every factor and all second-order data on every rank. HYBRID/MEM-OPT: the
    factors only on the rank that decomposes them (they are reduced to it); under MEM-OPT each
    factor and each layer's second-order data live on exactly one rank, so the fullest rank
    holds at least 1/P of the total. Totals counted from the modules' weight shapes."""
    sizes = _factor_sizes("resnet20", "cifar10")
    factors = sum((a * a + g * g) * 4 for a, g in sizes)
    second = sum((a * a + a + g * g + g + a * g) * 4 for a, g in sizes)
    memory = MemoryModel("resnet20", "cifar10")
    for ranks in (1, 4, 8):
        kfac = {}
        for method in ("kfac-comm-opt", "kfac-hybrid-opt", "kfac-mem-opt"):
            parts = memory.predict(MemoryConfig(method, ranks, 8)).parts
            kfac[method] = parts["kfac_factors"] + parts["kfac_second_order"]
        assert kfac["kfac-comm-opt"] == factors + second
        if ranks == 1:
            assert len(set(kfac.values())) == 1
            continue
        assert (factors + second) / ranks <= kfac["kfac-mem-opt"] < kfac["kfac-hybrid-opt"]
        assert kfac["kfac-hybrid-opt"] < kfac["kfac-comm-opt"]


def test_fosi_shards_its_state_over_ranks() -> None:
    """FOSI keeps parameters and gradients whole; the base optimizer's momentum, the k
    eigenvectors, the velocity and the non-finite check's zeros are sharded: (k + 3) shards
    of ⌈n / P⌉ floats."""
    shape, classes = INPUTS["digits"]
    n = sum(
        p.numel() for p in build_model(TrainConfig(model="small_cnn"), shape, classes).parameters()
    )
    memory = MemoryModel("small_cnn", "digits")
    for ranks in (1, 3, 4):
        parts = memory.predict(MemoryConfig("fosi", ranks, 8, fosi_k=3)).parts
        assert parts["parameters"] == parts["gradients"] == 4 * n
        shard = -(-n // ranks)
        assert (
            parts["optimizer"]
            + parts["fosi_vectors"]
            + parts["fosi_velocity"]
            + parts["fosi_finite_probe"]
            == (3 + 3) * 4 * shard
        )


@pytest.mark.parametrize(("dtype", "width"), [("float64", 8), ("training", 4)])
def test_a_kept_lanczos_basis_is_held_between_eses(dtype: str, width: int) -> None:
    """With ``fosi_keep_basis`` the basis (m × ⌈n / P⌉ in its dtype, m = 4(k + l); training:
    the parameters' float32) is a held part: every moment of the step rises by it but the
    ESE's, which counted it already."""
    shape, classes = INPUTS["digits"]
    n = sum(
        p.numel() for p in build_model(TrainConfig(model="small_cnn"), shape, classes).parameters()
    )
    memory = MemoryModel("small_cnn", "digits")
    for ranks in (1, 3):
        point = MemoryConfig("fosi", ranks, 8, fosi_k=3, fosi_lanczos_dtype=dtype)
        freed = memory.predict(point)
        kept = memory.predict(dataclasses.replace(point, fosi_keep_basis=True))
        basis = 4 * 3 * -(-n // ranks) * width
        assert "fosi_lanczos_basis" not in freed.parts
        assert kept.parts == freed.parts | {"fosi_lanczos_basis": basis}
        assert kept.moments["ese"] == freed.moments["ese"]
        for moment, value in freed.moments.items():
            if moment != "ese":
                assert kept.moments[moment] == value + basis, moment


def test_a_float32_basis_halves_the_basis_bytes() -> None:
    """``fosi_lanczos_dtype training`` (float32 parameters): the ESE's basis is half the
    float64 one's m × ⌈n / P⌉ × 8 bytes; no other moment moves."""
    shape, classes = INPUTS["digits"]
    n = sum(
        p.numel() for p in build_model(TrainConfig(model="small_cnn"), shape, classes).parameters()
    )
    memory = MemoryModel("small_cnn", "digits")
    for ranks in (1, 4):
        wide = memory.predict(MemoryConfig("fosi", ranks, 8, fosi_k=3, lanczos_iters=20))
        narrow = memory.predict(
            MemoryConfig(
                "fosi", ranks, 8, fosi_k=3, lanczos_iters=20, fosi_lanczos_dtype="training"
            )
        )
        float64_basis = 20 * -(-n // ranks) * 8
        assert wide.moments["ese"] - narrow.moments["ese"] == float64_basis / 2
        assert {k: v for k, v in wide.moments.items() if k != "ese"} == {
            k: v for k, v in narrow.moments.items() if k != "ese"
        }


@pytest.mark.parametrize(("fraction", "rows"), [(0.25, 4), (0.3, 5), (0.01, 1)])
def test_the_ese_holds_the_curvature_batchs_graph(fraction: float, rows: int) -> None:
    """At curvature fraction f the product's graph is that of the leading ⌈f · 16⌉ rows (the
    closure's own forward): the ESE's 2 × saved tensors are those of a forward at that batch
    (GPU paths: no im2col buffer); no other moment moves."""
    memory = MemoryModel("small_cnn", "digits")
    device = DeviceMemory(1e12)
    whole = memory.predict(MemoryConfig("fosi", 2, 16, fosi_k=3), device)
    part = memory.predict(
        MemoryConfig("fosi", 2, 16, fosi_k=3, fosi_curvature_fraction=fraction), device
    )
    saved_16, saved_rows = memory.trace(16).saved_bytes, memory.trace(rows).saved_bytes
    assert saved_rows < saved_16
    assert whole.moments["ese"] - part.moments["ese"] == 2 * (saved_16 - saved_rows)
    assert whole.moments["backward"] == part.moments["backward"]


def test_the_cost_models_memory_is_this_models_peak() -> None:
    """One memory model: a prediction's bytes are the peak this module gives the same point,
    on a profile's device (context and workspaces added) and on this machine's CPU paths."""
    path = resources.files("kfac_hpc.plan") / "profiles" / "v100-edr.toml"
    planned = build_cost_model("resnet20", "cifar10", str(path))
    device = device_memory(str(path))
    assert device is not None and planned.memory_limit == device.capacity_bytes
    memory = MemoryModel("resnet20", "cifar10")
    for method in ("sgd", "kfac-comm-opt", "kfac-hybrid-opt", "kfac-mem-opt", "fosi"):
        cfg = PlanConfig(method, 8, 16, "weak", fosi_k=3, lanczos_iters=6)
        point = MemoryConfig(method, 8, 16, fosi_k=3, lanczos_iters=6)
        assert planned.model.predict(cfg).memory_bytes == memory.predict(point, device).peak_bytes
        cpu = CostModel(planned.model.shape, planned.model.compute, planned.model.network)
        assert cpu.predict(cfg).memory_bytes == memory.predict(point).peak_bytes
