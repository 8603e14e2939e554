"""The distributed K-FAC preconditioner (SC'20 / KAISA): orchestration of the per-step phases.

Used as ``loss.backward(); preconditioner.step(); optimizer.step()``. Hooks capture each
registered layer's input (forward hook) and output gradient (a hook on the output tensor, so
in-place activations after the layer are fine); ``step()`` then runs the six K-FAC phases of
docs/contracts.md and writes the preconditioned gradients into ``.grad``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator
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
    FactorAllreducer,
    KAISAAssignment,
    KAISAGroups,
    any_rank,
)
from kfac_hpc.contracts.phases import KFAC_PHASES
from kfac_hpc.optim.factors import LayerFactors
from kfac_hpc.optim.layers import KFACLayer, make_layer
from kfac_hpc.optim.options import ComputeMethod, KFACOptions
from kfac_hpc.optim.second_order import (
    EigenFactor,
    decompose,
    eigen_outer,
    invert,
    pi_split,
    precondition_eigen,
    precondition_inverse,
)

__all__ = ["PHASES", "KFACPreconditioner"]

PHASES = KFAC_PHASES
STATE_FORMAT = 1
_FACTORS = ("A", "G")


class KFACPreconditioner:
    """K-FAC for the ``nn.Linear`` and ``nn.Conv2d`` layers of ``model`` (DDP-wrapped or not).

    Options are those of :class:`~kfac_hpc.optim.options.KFACOptions` (docs/kfac.md). Works
    without torch.distributed; with an initialised default process group, factors are averaged
    over all ranks and second-order work is spread as ``grad_worker_fraction`` says.
    """

    def __init__(self, model: nn.Module, **options: Any) -> None:
        valid = {f.name for f in dataclasses.fields(KFACOptions)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)}; valid options: {', '.join(sorted(valid))}"
            )
        self.options = KFACOptions(**options)
        # Layer names must not depend on DDP wrapping (checkpoints are keyed by them).
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        assert isinstance(inner, nn.Module)
        self.model = inner
        self.layers = self._register(self.model)
        self.factors = {name: LayerFactors() for name in self.layers}
        initialised = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if initialised else 1
        self.rank = dist.get_rank() if initialised else 0
        strategy = AssignmentStrategy(self.options.assignment_strategy)
        self.assignment = KAISAAssignment(
            {name: (layer.n_a, layer.n_g, layer.groups) for name, layer in self.layers.items()},
            self.world_size,
            self.options.grad_worker_fraction,
            strategy,
            self.options.colocate_factors,
        )
        self.groups = KAISAGroups.create(self.assignment, self.rank)
        self.reducer = FactorAllreducer(
            self.options.allreduce_bucket_cap_mb, symmetric=self.options.symmetry_aware
        )
        # Second-order data held by this rank: layer -> factor -> [Q, d] (eigen) or [inverse].
        self.second_order: dict[str, dict[str, list[Tensor]]] = {}
        self._outer: dict[str, Tensor] = {}
        self.steps = 0
        self.skipped_factor_updates = 0
        self.last_timings = dict.fromkeys(PHASES, 0.0)
        self._warned: set[str] = set()
        self._saved: dict[str, tuple[list[Tensor], list[Tensor]]] = {
            n: ([], []) for n in self.layers
        }
        self._submitted: set[str] = set()
        self._grad_multiplier: float | None = None
        self._ready: set[str] = set()
        self._capture = self._is_factor_step(0)
        self._handles: list[RemovableHandle] = [
            layer.module.register_forward_hook(partial(self._on_forward, name))
            for name, layer in self.layers.items()
        ]

    # ----------------------------------------------------------------- registration
    def _register(self, model: nn.Module) -> dict[str, KFACLayer]:
        skip = [s.lower() for s in self.options.skip_layers]
        layers: dict[str, KFACLayer] = {}
        for name, module in model.named_modules():
            kind = type(module).__name__.lower()
            if any(s in (name.lower(), kind) or name.lower().startswith(s + ".") for s in skip):
                continue
            # The model itself (a bare Linear) gets its class name: a key must not be empty.
            layer = make_layer(name or type(module).__name__, module)
            if layer is not None:
                layers[layer.name] = layer
        if not layers:
            warnings.warn("K-FAC found no Linear/Conv2d layer to precondition", stacklevel=3)
        return layers

    # ----------------------------------------------------------------- hyperparameters
    def hyperparameter(self, name: str, step: int | None = None) -> float | None:
        """The value of a scheduled option at ``step`` (default: the current step)."""
        schedule = self.options.schedules.get(name)
        return None if schedule is None else schedule(self.steps if step is None else step)

    def _is_factor_step(self, step: int) -> bool:
        return step % int(self.options.schedules["factor_update_steps"](step)) == 0

    def _is_inverse_step(self, step: int) -> bool:
        return step % int(self.options.schedules["inv_update_steps"](step)) == 0

    # ----------------------------------------------------------------- hooks
    def _factor_dtype(self, layer: KFACLayer) -> torch.dtype:
        return self.options.factor_dtype or layer.weight.dtype

    def _capturing(self, module: nn.Module) -> bool:
        return self._capture and module.training and torch.is_grad_enabled()

    def _on_forward(self, name: str, module: nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
        if not self._capturing(module) or not isinstance(out, Tensor) or not out.requires_grad:
            return
        layer = self.layers[name]
        self._check_not_submitted(name)
        if self.options.update_factors_in_hook:
            with self._no_autocast(out):
                self.factors[name].add_a(layer.a_factor(inputs[0], self._factor_dtype(layer)))
        else:
            self._saved[name][0].append(inputs[0].detach())
        out.register_hook(partial(self._on_output_grad, name))

    def _on_output_grad(self, name: str, grad: Tensor) -> None:
        if not self.options.update_factors_in_hook:
            self._saved[name][1].append(grad.detach())
            return
        self._check_not_submitted(name)
        layer, factors = self.layers[name], self.factors[name]
        with self._no_autocast(grad):
            factors.add_g(layer.g_factor(grad, self._multiplier(), self._factor_dtype(layer)))
        if factors.count_g == self.options.accumulation_steps and factors.has_pending():
            self._submit(name)  # launches its bucket when full: overlaps the rest of backward

    def _check_not_submitted(self, name: str) -> None:
        if name in self._submitted:
            raise RuntimeError(
                f"K-FAC layer {name} ran more than accumulation_steps="
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

    def _submit(self, name: str) -> None:
        factors = self.factors[name]
        assert factors.pending_a is not None and factors.pending_g is not None
        for key, tensor in (("A", factors.pending_a), ("G", factors.pending_g)):
            self.reducer.submit(f"{name}/{key}", tensor)
        self._submitted.add(name)

    # ----------------------------------------------------------------- the step
    def step(self) -> None:
        """Update factors / second-order data when due, precondition every registered gradient
        in place, apply the KL clip. Collective: every rank calls it at every step."""
        timings = dict.fromkeys(PHASES, 0.0)
        step = self.steps
        if self._capture:
            self._update_factors(timings)
        if self._is_inverse_step(step) or self._missing_second_order():
            self._update_second_order(timings)
        with self._timed(timings, "precondition"):
            pairs = self._precondition_own()
        with self._timed(timings, "grad_broadcast"):
            self._broadcast_gradients(pairs)
        with self._timed(timings, "precondition"):
            self._clip_and_write(pairs)
        self.last_timings = timings
        self.steps += 1
        self._capture = self._is_factor_step(self.steps)
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
            for name in self.layers:
                if name not in self._submitted and self.factors[name].has_pending():
                    self._submit(name)
        with self._timed(timings, "factor_comm"):
            self.reducer.wait()
        with self._timed(timings, "factor_compute"):
            self._commit_factors()

    def _compute_saved_factors(self) -> None:
        """Factors from inputs/output gradients saved during the step (hook updates off)."""
        for name, (inputs, grads) in self._saved.items():
            layer, factors = self.layers[name], self.factors[name]
            dtype = self._factor_dtype(layer)
            with torch.no_grad():
                for x in inputs:
                    factors.add_a(layer.a_factor(x, dtype))
                for g in grads:
                    factors.add_g(layer.g_factor(g, self._multiplier(), dtype))
            inputs.clear()
            grads.clear()

    def _commit_factors(self) -> None:
        """Fold this step's statistics into the running averages, unless any rank saw inf/NaN
        in them or in a gradient (one host sync for all layers)."""
        names = [n for n in self._submitted if self.factors[n].has_pending()]
        checked: list[Tensor] = []
        for n in names:
            checked += [self.factors[n].pending_a, self.factors[n].pending_g]  # type: ignore[list-item]
        checked += [p.grad for p in self.model.parameters() if p.grad is not None]
        finite = (
            bool(torch.stack([torch.isfinite(t).all() for t in checked]).all()) if checked else True
        )
        if any_rank(not finite, device=checked[0].device if checked else None):
            self.skipped_factor_updates += 1
            for n in names:
                self.factors[n].clear_pending()
        else:
            decay = float(self.options.schedules["factor_decay"](self.steps))
            for n in names:
                self.factors[n].commit(decay)
        self._submitted.clear()

    # ----------------------------------------------------------------- second order
    def _update_second_order(self, timings: dict[str, float]) -> None:
        damping = float(self.options.schedules["damping"](self.steps))
        with self._timed(timings, "inverse_compute"):
            ready = self._compute_own_second_order(damping)
        with self._timed(timings, "inverse_comm"):
            self._broadcast_second_order(ready)
        with self._timed(timings, "inverse_compute"):
            self._outer.clear()
            if self._eigen and self.options.compute_eigenvalue_outer_product:
                for name in ready:
                    self._set_outer(name, damping)
        self._ready = set(ready)

    def _missing_second_order(self) -> bool:
        """Whether a layer has factors but no second-order data yet (e.g. after its first
        factor update came late, or after loading a checkpoint without second-order data)."""
        return any(f.A is not None and n not in self._ready for n, f in self.factors.items())

    @property
    def _eigen(self) -> bool:
        return self.options.compute_method is ComputeMethod.EIGEN

    def _holds(self, name: str) -> bool:
        """Whether this rank keeps (and preconditions with) the layer's second-order data."""
        return self.assignment.is_grad_worker(name, self.rank)

    def _compute_own_second_order(self, damping: float) -> list[str]:
        """Decompose the factors this rank is the inverse worker of; return the layers whose
        second-order data exists (on the grad workers) after the broadcasts."""
        ready: list[str] = []
        for name, factors in self.factors.items():
            if factors.A is None or factors.G is None:
                continue
            ready.append(name)
            plan = self.assignment.plan(name)
            held = self.second_order.setdefault(name, {}) if self._holds(name) else None
            split = None if self._eigen else pi_split(factors.A, factors.G, damping)
            for index, key in enumerate(_FACTORS):
                if (plan.a_worker, plan.g_worker)[index] != self.rank:
                    continue
                assert held is not None, "an inverse worker is always a grad worker"
                matrix = factors.A if key == "A" else factors.G
                held[key] = self._decompose(name, key, matrix, split[index] if split else None)
        return ready

    def _decompose(
        self, name: str, key: str, matrix: Tensor, damping: Tensor | None
    ) -> list[Tensor]:
        dtype = self.options.inv_dtype
        if damping is None:
            eig = decompose(matrix, dtype)
            result = None if eig is None else [eig.Q.contiguous(), eig.d.contiguous()]
        else:
            inv = invert(matrix, damping, dtype)
            result = None if inv is None else [inv.contiguous()]
        if result is not None:
            return result
        previous = self.second_order.get(name, {}).get(key)
        if name not in self._warned:
            self._warned.add(name)
            kept = "keeping the previous one" if previous else "using the identity"
            warnings.warn(
                f"K-FAC: {'eigh' if damping is None else 'inv'} of factor {key} of layer {name} "
                f"failed in {dtype}, float64 and with jitter; {kept} (warned once per layer)",
                RuntimeWarning,
                stacklevel=4,
            )
        return previous if previous is not None else self._identity(matrix, damping is None)

    def _identity(self, matrix: Tensor, eigen: bool) -> list[Tensor]:
        """Second-order data that leaves a gradient (nearly) as it is: used only when the very
        first decomposition of a factor fails."""
        dtype = self.options.inv_dtype
        eye = torch.eye(matrix.shape[-1], dtype=dtype, device=matrix.device).expand_as(matrix)
        if not eigen:
            return [eye.contiguous()]
        return [eye.contiguous(), torch.ones(matrix.shape[:-1], dtype=dtype, device=matrix.device)]

    def _broadcast_second_order(self, ready: list[str]) -> None:
        broadcaster = AsyncBroadcaster()
        for name in ready:
            for key, src, group in self.groups.second_order_broadcasts(name):
                held = self.second_order.setdefault(name, {})
                if src != self.rank:
                    held[key] = self._empty_second_order(name, key)
                for tensor in held[key]:
                    broadcaster.broadcast(tensor, src, group)
        broadcaster.wait()

    def _empty_second_order(self, name: str, key: str) -> list[Tensor]:
        layer = self.layers[name]
        shape = layer.factor_shapes[_FACTORS.index(key)]
        dtype, device = self.options.inv_dtype, layer.weight.device
        if self._eigen:
            return [
                torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape[:-1], dtype=dtype, device=device),
            ]
        return [torch.empty(shape, dtype=dtype, device=device)]

    def _set_outer(self, name: str, damping: float) -> None:
        held = self.second_order.get(name)
        if held is not None and "A" in held and "G" in held:
            self._outer[name] = eigen_outer(held["A"][1], held["G"][1], damping)

    # ----------------------------------------------------------------- preconditioning
    def _precondition_own(self) -> list[tuple[KFACLayer, Tensor, Tensor]]:
        """(layer, gradient, preconditioned gradient) for every registered layer with a
        gradient; layers this rank is not a grad worker of get a buffer to receive into."""
        damping = float(self.options.schedules["damping"](self.steps))
        pairs: list[tuple[KFACLayer, Tensor, Tensor]] = []
        for name, layer in self.layers.items():
            if layer.weight.grad is None:
                continue
            grad = layer.grad_matrix()
            held = self.second_order.get(name)
            if not self._holds(name) or held is None or len(held) < 2:
                pairs.append((layer, grad, grad.clone()))
            elif self._eigen:
                a, g = held["A"], held["G"]
                outer = self._outer.get(name)
                pairs.append((layer, grad, self._apply_eigen(grad, a, g, damping, outer)))
            else:
                pairs.append((layer, grad, precondition_inverse(grad, held["A"][0], held["G"][0])))
        return pairs

    @staticmethod
    def _apply_eigen(
        grad: Tensor, a: list[Tensor], g: list[Tensor], damping: float, outer: Tensor | None
    ) -> Tensor:
        return precondition_eigen(grad, EigenFactor(*a), EigenFactor(*g), damping, outer)

    def _broadcast_gradients(self, pairs: list[tuple[KFACLayer, Tensor, Tensor]]) -> None:
        """Send each preconditioned gradient from its grad worker down its column (MEM-OPT,
        HYBRID-OPT). ``_ready`` is the same on every rank, so all take the same decisions."""
        broadcaster = AsyncBroadcaster()
        for layer, _, update in pairs:
            route = self.groups.grad_broadcast(layer.name)
            if route is not None and layer.name in self._ready:
                broadcaster.broadcast(update, *route)
        broadcaster.wait()

    def _clip_and_write(self, pairs: list[tuple[KFACLayer, Tensor, Tensor]]) -> None:
        """Scale every preconditioned gradient by ν = min(1, sqrt(κ / |lr² Σ⟨V, ∇W⟩|)) without a
        host sync, and write it into ``.grad``. Unregistered parameters are left alone."""
        kl_clip = self.hyperparameter("kl_clip")
        if kl_clip is not None and pairs:
            lr = float(self.options.schedules["lr"](self.steps))
            vg = torch.stack([(v * g).sum().to(torch.float64) for _, g, v in pairs]).sum()
            nu = torch.sqrt(kl_clip / (lr * lr * vg).abs()).clamp(max=1.0)
            for layer, _, v in pairs:
                layer.set_grad(v.mul_(nu.to(v.dtype)))
            return
        for layer, _, v in pairs:
            layer.set_grad(v)

    # ----------------------------------------------------------------- state
    def recompute_second_order(self) -> None:
        """Recompute (and distribute) all second-order data from the current factors now,
        e.g. after ``load_state_dict`` of a checkpoint saved without it. Collective."""
        self._update_second_order(dict.fromkeys(PHASES, 0.0))

    def state_dict(self, include_second_order: bool = False) -> dict[str, Any]:
        """Plain nested state, keyed by layer name and independent of the rank layout.

        ``layers[name]`` holds ``A`` and ``G`` (layers that have factors); with
        ``include_second_order`` also what this rank holds of ``QA``/``dA``/``QG``/``dG``
        (eigen) or ``A_inv``/``G_inv`` (inverse).
        """
        layers: dict[str, dict[str, Tensor]] = {}
        for name, factors in self.factors.items():
            if factors.A is None or factors.G is None:
                continue
            entry = {"A": factors.A.detach().clone(), "G": factors.G.detach().clone()}
            if include_second_order:
                for key, tensors in self.second_order.get(name, {}).items():
                    entry.update(
                        zip(self._second_order_keys(key), (t.clone() for t in tensors), strict=True)
                    )
            layers[name] = entry
        schedules = {
            name: s.state_dict() for name, s in self.options.schedules.items() if s.is_stateful
        }
        return {
            "format": STATE_FORMAT,
            "steps": self.steps,
            "skipped_factor_updates": self.skipped_factor_updates,
            "compute_method": self.options.compute_method.value,  # type: ignore[union-attr]
            "schedules": schedules,
            "layers": layers,
        }

    def _second_order_keys(self, factor: str) -> tuple[str, ...]:
        return (f"Q{factor}", f"d{factor}") if self._eigen else (f"{factor}_inv",)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The exact inverse of :meth:`state_dict`; checks every shape first (nothing is
        changed when a check fails). Second-order data not in ``state`` is recomputed from
        the loaded factors at the next ``step()`` (or call :meth:`recompute_second_order`)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"K-FAC state format {state.get('format')!r} is not {STATE_FORMAT}")
        unknown = sorted(set(state["layers"]) - set(self.layers))
        if unknown:
            raise ValueError(f"K-FAC state has layers this model lacks: {', '.join(unknown)}")
        for name, entry in state["layers"].items():
            self._check_shapes(name, entry)
        same_method = state.get("compute_method") == self.options.compute_method.value  # type: ignore[union-attr]
        self.steps = int(state["steps"])
        self.skipped_factor_updates = int(state.get("skipped_factor_updates", 0))
        for name, schedule_state in state.get("schedules", {}).items():
            self.options.schedules[name].load_state_dict(schedule_state)
        self.second_order.clear()
        self._outer.clear()
        self._ready = set()
        for name, layer in self.layers.items():
            factors = self.factors[name] = LayerFactors()
            entry = state["layers"].get(name)
            if entry is None:
                continue
            device = layer.weight.device
            factors.A = entry["A"].to(device=device, dtype=self._factor_dtype(layer)).clone()
            factors.G = entry["G"].to(device=device, dtype=self._factor_dtype(layer)).clone()
            keys = [k for f in _FACTORS for k in self._second_order_keys(f)]
            if same_method and all(k in entry for k in keys):
                # Every rank sees the same state, so all agree on what is ready (a layer marked
                # missing on some ranks only would make them run collectives alone).
                self._ready.add(name)
                if self._holds(name):
                    self._load_second_order(name, entry, device)
        self._capture = self._is_factor_step(self.steps)

    def _check_shapes(self, name: str, entry: dict[str, Tensor]) -> None:
        shapes = dict(zip(_FACTORS, self.layers[name].factor_shapes, strict=True))
        for key, expected in shapes.items():
            got = tuple(entry[key].shape) if key in entry else None
            if got != expected:
                raise ValueError(
                    f"K-FAC state for layer {name}: factor {key} has shape {got}, the model "
                    f"needs {expected}"
                )

    def _load_second_order(self, name: str, entry: dict[str, Tensor], device: torch.device) -> None:
        self.second_order[name] = {
            key: [
                entry[k].to(device=device, dtype=self.options.inv_dtype).clone()
                for k in self._second_order_keys(key)
            ]
            for key in _FACTORS
        }
        if self._eigen and self.options.compute_eigenvalue_outer_product:
            self._set_outer(name, float(self.options.schedules["damping"](self.steps)))

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds: ``factors_bytes`` (running A and G), ``second_order_bytes``
        (eigen/inverse data and precomputed outer products) and ``total_bytes``."""
        factors = sum(f.nbytes() for f in self.factors.values())
        tensors = [t for held in self.second_order.values() for ts in held.values() for t in ts]
        tensors += list(self._outer.values())
        second = sum(t.numel() * t.element_size() for t in tensors)
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
            f"layers={len(self.layers)}",
            f"world_size={self.world_size}",
            f"distribution={self.assignment.distribution.value}",
            f"compute_method={o.compute_method.value}",  # type: ignore[union-attr]
        ]
        fields += [f"{name}={s!r}" for name, s in o.schedules.items()]
        lines = [f"  {layer.describe()}" for layer in self.layers.values()]
        return "KFACPreconditioner(" + ", ".join(fields) + ")\n" + "\n".join(lines)
