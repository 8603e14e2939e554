"""The distributed K-FAC preconditioner (SC'20 / KAISA): orchestration of the per-step phases.

Used as ``loss.backward(); preconditioner.step(); optimizer.step()``. Hooks capture each
registered layer's input (forward hook) and output gradient (a hook on the output tensor, so
in-place activations after the layer are fine); ``step()`` then runs the six K-FAC phases of
docs/contracts.md and writes the preconditioned gradients into ``.grad``. Eigen vs inverse is
a :class:`~kfac_hpc.optim.decomposition_methods.SecondOrderMethod` chosen once; each layer's
state is one :class:`~kfac_hpc.optim.layer_state.LayerState`; saving and loading are in
:mod:`kfac_hpc.optim.kfac_state`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac_hpc.comm import (
    AssignmentStrategy,
    AsyncBroadcaster,
    DistributionStrategy,
    KAISAAssignment,
    KAISAGroups,
    any_rank,
)
from kfac_hpc.contracts.phases import KFAC_PHASES
from kfac_hpc.optim.decompose_and_broadcast import SecondOrderUpdate
from kfac_hpc.optim.decomposition_methods import SecondOrder, make_method
from kfac_hpc.optim.factor_reduction import FactorReduction
from kfac_hpc.optim.factors import LayerFactors
from kfac_hpc.optim.finite import all_finite
from kfac_hpc.optim.kfac_state import KFACStateMixin
from kfac_hpc.optim.layer_state import LayerState
from kfac_hpc.optim.layers import KFACApprox, KFACLayer, make_layer
from kfac_hpc.optim.options import ComputeMethod, DampingMode, GradScalerLike, KFACOptions
from kfac_hpc.optim.schedules import Hyperparameter

__all__ = ["PHASES", "KFACPreconditioner"]

PHASES = KFAC_PHASES


class KFACPreconditioner(KFACStateMixin):
    """K-FAC for the ``nn.Linear`` and ``nn.Conv2d`` layers of ``model`` (DDP-wrapped or not).

    Every option is explained in docs/kfac.md; each is validated by
    :class:`~kfac_hpc.optim.options.KFACOptions` (``ValueError`` naming it). Hyperparameters
    may be numbers, callables of the step or scheduler objects. Works without
    torch.distributed; with an initialised default process group, factors are averaged over all
    ranks and second-order work is spread as ``grad_worker_fraction`` says.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Hyperparameter = 1,
        inv_update_steps: Hyperparameter = 1,
        damping: Hyperparameter = 0.001,
        factor_decay: Hyperparameter = 0.95,
        kl_clip: Hyperparameter | None = 0.001,
        lr: Hyperparameter = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        damping_mode: DampingMode | str = DampingMode.PI_SPLIT,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: str | float = "comm-opt",
        symmetry_aware: bool = False,
        grad_scaler: GradScalerLike | None = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: Sequence[str] = (),
        update_factors_in_hook: bool = True,
        synchronize_timings: bool = False,
        kfac_approx: KFACApprox | str = KFACApprox.EXPAND,
        factor_sample_fraction: float = 1.0,
    ) -> None:
        self.options = KFACOptions(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors,
            compute_method=compute_method,
            damping_mode=damping_mode,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            grad_worker_fraction=grad_worker_fraction,
            symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            skip_layers=skip_layers,
            update_factors_in_hook=update_factors_in_hook,
            synchronize_timings=synchronize_timings,
            kfac_approx=kfac_approx,
            factor_sample_fraction=factor_sample_fraction,
        )
        # Layer names must not depend on DDP wrapping (checkpoints are keyed by them).
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        assert isinstance(inner, nn.Module)
        self.model = inner
        self.states = {layer.name: LayerState(layer) for layer in self._register(inner)}
        initialised = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if initialised else 1
        self.rank = dist.get_rank() if initialised else 0
        self.assignment = KAISAAssignment(
            {n: (s.layer.n_a, s.layer.n_g, s.layer.groups) for n, s in self.states.items()},
            self.world_size,
            self.options.grad_worker_fraction,
            AssignmentStrategy(self.options.assignment_strategy),
            self.options.colocate_factors,
        )
        self.groups = KAISAGroups.create(self.assignment, self.rank)
        self.method = make_method(
            ComputeMethod(self.options.compute_method),
            self.options.inv_dtype,
            self.options.compute_eigenvalue_outer_product,
            DampingMode(self.options.damping_mode),
        )
        for state in self.states.values():
            state.holders = self._factor_holders(state.name)
        self.second_order_update = SecondOrderUpdate(
            self.states, self.method, self.assignment, self.groups, self.rank
        )
        self.steps = 0
        self.skipped_factor_updates = 0
        self.last_timings = dict.fromkeys(PHASES, 0.0)
        self._grad_multiplier: float | None = None
        self._capture = self.options.is_factor_step(0)
        self.reducer = FactorReduction(
            list(self.states.values()),
            self.options.allreduce_bucket_cap_mb,
            self.options.symmetry_aware,
            self.world_size,
            self.rank,
            self.options.factor_dtype,
        )
        self._handles: list[RemovableHandle] = [
            s.layer.module.register_forward_hook(partial(self._on_forward, name))
            for name, s in self.states.items()
        ]

    # ----------------------------------------------------------------- views
    @property
    def layers(self) -> dict[str, KFACLayer]:
        """The registered layers by name, in registration order."""
        return {name: s.layer for name, s in self.states.items()}

    @property
    def factors(self) -> dict[str, LayerFactors]:
        """Each layer's running factors."""
        return {name: s.factors for name, s in self.states.items()}

    @property
    def second_order(self) -> dict[str, dict[str, SecondOrder]]:
        """What this rank holds of each layer's second-order data ("A"/"G")."""
        return {name: dict(s.second_order) for name, s in self.states.items() if s.second_order}

    # ----------------------------------------------------------------- registration
    def _register(self, model: nn.Module) -> list[KFACLayer]:
        skip = [s.lower() for s in self.options.skip_layers]
        layers: list[KFACLayer] = []
        for name, module in model.named_modules():
            kind = type(module).__name__.lower()
            if any(s in (name.lower(), kind) or name.lower().startswith(s + ".") for s in skip):
                continue
            # The model itself (a bare Linear) gets its class name: a key must not be empty.
            layer = make_layer(
                name or type(module).__name__,
                module,
                self.options.kfac_approx,  # type: ignore[arg-type]
                self.options.factor_sample_fraction,
            )
            if layer is not None:
                layers.append(layer)
        if not layers:
            warnings.warn("K-FAC found no Linear/Conv2d layer to precondition", stacklevel=3)
        return layers

    def _factor_holders(self, name: str) -> dict[str, tuple[int, ...]]:
        """The ranks that keep each running factor of layer ``name``: every rank under COMM-OPT
        (empty); otherwise only its inverse worker(s): the eigen method needs a factor on its
        own worker, the inverse method both factors on both workers (π-damping)."""
        if self.assignment.distribution is DistributionStrategy.COMM_OPT:
            return {}
        plan = self.assignment.plan(name)
        if self.method.kind is ComputeMethod.EIGEN:
            return {"A": (plan.a_worker,), "G": (plan.g_worker,)}
        both = tuple(sorted({plan.a_worker, plan.g_worker}))
        return {"A": both, "G": both}

    # ----------------------------------------------------------------- hyperparameters
    def hyperparameter(self, name: str, step: int | None = None) -> float | None:
        """The value of a scheduled option at ``step`` (default: the current step)."""
        schedule = self.options.schedules.get(name)
        return None if schedule is None else schedule(self.steps if step is None else step)

    def _value(self, name: str) -> float:
        return self.options.value(name, self.steps)

    # ----------------------------------------------------------------- hooks
    def _factor_dtype(self, layer: KFACLayer) -> torch.dtype:
        return self.options.factor_dtype or layer.weight.dtype

    def _capturing(self, module: nn.Module) -> bool:
        return self._capture and module.training and torch.is_grad_enabled()

    def _on_forward(self, name: str, module: nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
        if not self._capturing(module) or not isinstance(out, Tensor) or not out.requires_grad:
            return
        state = self.states[name]
        if self.options.update_factors_in_hook:
            self._check_runs(state, len(state.inputs) + state.factors.count_a)
        # With hook updates A is computed in the output-gradient hook, from the input autograd
        # keeps anyway for the weight gradient: no statistics exist while the activations peak.
        state.inputs.append(inputs[0].detach())
        out.register_hook(partial(self._on_output_grad, state))

    def _on_output_grad(self, state: LayerState, grad: Tensor) -> None:
        if not self.options.update_factors_in_hook:
            state.grads.append(grad.detach())
            return
        layer, factors = state.layer, state.factors
        self._check_runs(state, factors.count_g)
        dtype = self._factor_dtype(layer)
        with self._no_autocast(grad):
            for x in state.inputs:
                factors.add_a(layer.a_factor(x, dtype))
            state.inputs.clear()
            factors.add_g(layer.g_factor(grad, self._multiplier(), dtype))
        if factors.count_g == self.options.accumulation_steps:
            self.reducer.mark_ready(state)  # launches full buckets: overlaps backward

    def _check_runs(self, state: LayerState, seen: int) -> None:
        """Raise when a layer runs once more after ``seen`` of accumulation_steps runs."""
        if seen >= self.options.accumulation_steps:
            raise RuntimeError(
                f"K-FAC layer {state.name} ran more than accumulation_steps="
                f"{self.options.accumulation_steps} times in one step; with a module used "
                "several times per forward pass set update_factors_in_hook=False"
            )

    @staticmethod
    @contextmanager
    def _no_autocast(tensor: Tensor) -> Iterator[None]:
        # Factors are sums of many products: keep them out of float16 autocast.
        with torch.autocast(tensor.device.type, enabled=False), torch.no_grad():
            yield

    def _multiplier(self) -> float:
        """c = N·accumulation_steps/grad_scale without N (applied per batch): see layers.py."""
        if self._grad_multiplier is None:
            scaler = self.options.grad_scaler
            scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
            self._grad_multiplier = self.options.accumulation_steps / scale
        return self._grad_multiplier

    # ----------------------------------------------------------------- the step
    def step(self) -> None:
        """Update factors / second-order data when due, precondition every registered gradient
        in place, apply the KL clip. Collective: every rank calls it at every step."""
        timings = dict.fromkeys(PHASES, 0.0)
        if self._capture:
            self._update_factors(timings)
        if self.options.is_inverse_step(self.steps) or self.second_order_update.missing():
            self._update_second_order(timings)
        with self._timed(timings, "precondition"):
            triples = self._precondition_own()
        if self.assignment.distribution is not DistributionStrategy.COMM_OPT:
            with self._timed(timings, "grad_broadcast"):  # COMM-OPT: every rank has them all
                self._broadcast_gradients(triples)
        with self._timed(timings, "precondition"):
            self._clip_and_write(triples)
        self.last_timings = timings
        self.steps += 1
        self._capture = self.options.is_factor_step(self.steps)
        self._grad_multiplier = None

    @contextmanager
    def _timed(self, timings: dict[str, float], phase: str) -> Iterator[None]:
        sync = self.options.synchronize_timings and torch.cuda.is_available()
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if sync:
            torch.cuda.synchronize()
        timings[phase] += time.perf_counter() - start

    def _update_factors(self, timings: dict[str, float]) -> None:
        with self._timed(timings, "factor_compute"):
            self._compute_saved_factors()
            self.reducer.submit_rest(self.options.accumulation_steps)
        with self._timed(timings, "factor_comm"):
            live = self.reducer.wait()
        with self._timed(timings, "factor_compute"):
            self._commit_factors(live)

    def _compute_saved_factors(self) -> None:
        """Factors from inputs/output gradients saved during the step (hook updates off)."""
        for state in self.states.values():
            layer, factors = state.layer, state.factors
            dtype = self._factor_dtype(layer)
            with torch.no_grad():
                for x in state.inputs:
                    factors.add_a(layer.a_factor(x, dtype))
                for g in state.grads:
                    factors.add_g(layer.g_factor(g, self._multiplier(), dtype))
            state.inputs.clear()
            state.grads.clear()

    def _commit_factors(self, states: list[LayerState]) -> None:
        """Fold this step's statistics of ``states`` into the running averages, unless any rank
        saw inf/NaN in them (each is checked on the ranks that received it) or in a gradient
        (one host sync for all layers, one summing pass per tensor)."""
        checked = [
            t for s in states for t in (s.factors.pending_a, s.factors.pending_g) if t is not None
        ]
        checked += [p.grad for p in self.model.parameters() if p.grad is not None]
        finite = all_finite(checked)
        if any_rank(not finite, device=checked[0].device if checked else None):
            self.skipped_factor_updates += 1
            for s in states:
                s.factors.clear_pending()
        else:
            decay = self._value("factor_decay")
            for s in states:
                s.factors.commit(decay, s.keeps("A", self.rank), s.keeps("G", self.rank))

    # ----------------------------------------------------------------- second order
    def _update_second_order(self, timings: dict[str, float]) -> None:
        self.second_order_update.run(self._value("damping"), partial(self._timed, timings))

    def _holds(self, name: str) -> bool:
        """Whether this rank keeps (and preconditions with) the layer's second-order data."""
        return self.assignment.is_grad_worker(name, self.rank)

    # ----------------------------------------------------------------- preconditioning
    def _precondition_own(self) -> list[tuple[LayerState, Tensor, Tensor]]:
        """(layer, gradient, preconditioned gradient) for every registered layer with a
        gradient; layers this rank is not a grad worker of get a buffer to receive into."""
        damping = self._value("damping")
        triples: list[tuple[LayerState, Tensor, Tensor]] = []
        for state in self.states.values():
            if state.layer.weight.grad is None:
                continue
            grad = state.layer.grad_matrix()
            if not self._holds(state.name) or not state.holds_both():
                triples.append((state, grad, grad.clone()))
                continue
            a, g = state.second_order["A"], state.second_order["G"]
            triples.append(
                (state, grad, self.method.precondition(grad, a, g, damping, state.outer))
            )
        return triples

    def _broadcast_gradients(self, triples: list[tuple[LayerState, Tensor, Tensor]]) -> None:
        """Send each preconditioned gradient from its grad worker down its column (MEM-OPT,
        HYBRID-OPT). ``ready`` is the same on every rank, so all take the same decisions."""
        broadcaster = AsyncBroadcaster()
        for state, _, update in triples:
            route = self.groups.grad_broadcast(state.name)
            if route is not None and state.ready:
                broadcaster.broadcast(update, *route)
        broadcaster.wait()

    def _clip_and_write(self, triples: list[tuple[LayerState, Tensor, Tensor]]) -> None:
        """Scale every preconditioned gradient by ν = min(1, sqrt(κ / |lr² Σ⟨V, ∇W⟩|)) without a
        host sync, and write it into ``.grad``. Unregistered parameters are left alone."""
        kl_clip = self.hyperparameter("kl_clip")
        if kl_clip is not None and triples:
            lr = self._value("lr")
            vg = torch.stack([(v * g).sum().to(torch.float64) for _, g, v in triples]).sum()
            nu = torch.sqrt(kl_clip / (lr * lr * vg).abs()).clamp(max=1.0)
            for state, _, v in triples:
                state.layer.set_grad(v.mul_(nu.to(v.dtype)))
            return
        for state, _, v in triples:
            state.layer.set_grad(v)

    # ----------------------------------------------------------------- the rest
    def recompute_second_order(self) -> None:
        """Recompute (and distribute) all second-order data from the current factors now,
        e.g. after ``load_state_dict`` of a checkpoint saved without it. Collective."""
        self._update_second_order(dict.fromkeys(PHASES, 0.0))

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds: ``factors_bytes`` (running A and G), ``second_order_bytes``
        (eigen/inverse data and precomputed outer products) and ``total_bytes``."""
        factors = sum(s.factors.nbytes() for s in self.states.values())
        second = sum(s.second_order_bytes() for s in self.states.values())
        return {
            "factors_bytes": factors,
            "second_order_bytes": second,
            "total_bytes": factors + second,
        }

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model (it stops capturing)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        o = self.options
        fields = [
            f"layers={len(self.states)}",
            f"world_size={self.world_size}",
            f"distribution={self.assignment.distribution.value}",
            f"compute_method={self.method.kind.value}",
        ]
        fields += [f"{name}={s!r}" for name, s in o.schedules.items()]
        lines = [f"  {s.layer.describe()}" for s in self.states.values()]
        return "KFACPreconditioner(" + ", ".join(fields) + ")\n" + "\n".join(lines)
