"""What a checkpoint was saved with (workload, training method, base optimizer), and whether
this run may continue it: the job refuses another model, dataset, method or base optimizer by
name before anything is loaded (docs/train.md, "Resume").

Checkpoints of the job record them by name (``extra``: ``workload``, ``method``,
``optimizer``). Older ones
are judged by what is there: the saved config's ``--optimizer`` and method switches, else the
method's state group (``kfac_state``, ``fosi_state``) and the saved optimizer settings (SGD's
momentum, the Adam family's betas; Adam and AdamW apart only by ``decoupled_weight_decay``,
where torch records it). What cannot be told is not refused here (the state checks that follow
still apply).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.options import FIRST_ORDER, METHOD_SWITCHES, OPTIONS, method_of

__all__ = [
    "Mismatch",
    "recorded",
    "saved_method",
    "saved_optimizers",
    "saved_workload",
    "training_mismatch",
]

# The job's --optimizer values by torch class (FOSI's state names its base's class).
_BY_CLASS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}
_SWITCH_OF = {method: switch for switch, method in METHOD_SWITCHES.items()}
_STATE_GROUPS = {"kfac_state": "kfac", "fosi_state": "fosi"}  # the methods' checkpoint groups


class Mismatch(NamedTuple):
    """The setting (option name) that differs from the checkpoint's: as flags, the
    checkpoint's and this run's."""

    field: str
    saved: str
    mine: str

    def reason(self, where: str = "") -> str:
        """One line saying what to do; ``where`` is added to the closing parenthesis."""
        return (
            f"checkpoint was saved with {self.saved}; resume with the same or start a new run "
            f"(this run has {self.mine}{where})"
        )


def recorded(method: str, optimizer: str, workload: Mapping[str, Any]) -> dict[str, str]:
    """What the job records in every checkpoint's ``extra``: the method, ``--optimizer`` and
    the workload (``model``, ``model_args``, ``dataset``, ``dataset_args``, as JSON)."""
    return {
        "method": method,
        "optimizer": optimizer,
        "workload": json.dumps(dict(workload), sort_keys=True),
    }


def saved_workload(tree: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The workload a checkpoint was saved with: recorded by name, else what its saved
    config names (model and dataset only where the arguments were not recorded)."""
    text = _extra(tree).get("workload")
    if isinstance(text, str):
        try:
            saved = json.loads(text)
            if isinstance(saved, dict):
                return saved
        except ValueError:
            pass
    return {k: config[k] for k in ("model", "dataset") if isinstance(config.get(k), str)}


def _workload_flags(workload: Mapping[str, Any], kind: str) -> str:
    """A workload's model or dataset as the flags that name it."""
    args = workload.get(f"{kind}_args") or {}
    flags = [f"{OPTIONS[kind].flag} {workload.get(kind)}"]
    flags += [f"{OPTIONS[kind + '_arg'].flag} {k}={v}" for k, v in sorted(args.items())]
    return " ".join(flags)


def _workload_mismatch(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> Mismatch | None:
    for kind in ("model", "dataset"):
        keys = [k for k in (kind, f"{kind}_args") if k in saved]
        if any(saved[k] != mine.get(k) for k in keys):
            return Mismatch(kind, _workload_flags(saved, kind), _workload_flags(mine, kind))
    return None


def _extra(tree: Mapping[str, Any]) -> Mapping[str, Any]:
    extra = tree.get("extra")
    return extra if isinstance(extra, Mapping) else {}


def saved_method(tree: Mapping[str, Any], config: Mapping[str, Any]) -> tuple[str | None, bool]:
    """The method that saved the checkpoint ``tree`` (None: cannot tell), and whether it was
    recorded by name (the method's ``name``) rather than judged from the config's switches or
    the state groups (a ``TrainConfig.method``)."""
    name = _extra(tree).get("method")
    if isinstance(name, str):
        return name, True
    if any(switch in config for switch in METHOD_SWITCHES):
        try:
            return method_of(config), False
        except InputError:  # two switches on: not a config the job wrote; judge by the state
            pass
    for group, method in _STATE_GROUPS.items():
        if group in tree:
            return method, False
    return None, False


def _kinds_of(groups: Any) -> frozenset[str]:
    """The --optimizer values whose parameter-group settings ``groups`` holds."""
    group = groups[0] if isinstance(groups, list) and groups else None
    if not isinstance(group, Mapping):
        return frozenset()
    if "betas" in group:
        decoupled = group.get("decoupled_weight_decay")
        if decoupled is None:  # torch before the key: Adam and AdamW look alike
            return frozenset({"adam", "adamw"})
        return frozenset({"adamw" if bool(decoupled) else "adam"})
    if "momentum" in group or "nesterov" in group:
        return frozenset({"sgd"})
    return frozenset()


def saved_optimizers(tree: Mapping[str, Any], config: Mapping[str, Any]) -> frozenset[str]:
    """The --optimizer values the checkpoint ``tree`` may have been saved with (one when
    recorded; empty when it cannot be told)."""
    for name in (_extra(tree).get("optimizer"), config.get("optimizer")):
        if isinstance(name, str):
            return frozenset({name})
    fosi = tree.get("fosi_state")
    if isinstance(fosi, Mapping):
        base = fosi.get("base_optimizer")
        if isinstance(base, str) and base in _BY_CLASS:
            return frozenset({_BY_CLASS[base]})
        state = fosi.get("base")
    else:
        state = tree.get("optimizer")
    return _kinds_of(state.get("param_groups") if isinstance(state, Mapping) else None)


def _with(method: str) -> str:
    """A method as the flags that select it."""
    if method == FIRST_ORDER:
        return f"--no-{OPTIONS['kfac'].flag[2:]} (first order)"
    switch = _SWITCH_OF.get(method)
    return OPTIONS[switch].flag if switch is not None else f"method {method}"


def training_mismatch(
    tree: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    method: str,
    config_method: str,
    optimizer: str,
    workload: Mapping[str, Any],
) -> Mismatch | None:
    """Why a checkpoint (``tree``, saved under ``config``) cannot be continued by a run of
    ``workload`` (:func:`recorded`'s), ``method`` (its registered name; ``config_method`` is
    what its config's switches say) around ``--optimizer optimizer``: another model or
    dataset, else another method, else another base optimizer; None when all are the same or
    cannot be told."""
    other = _workload_mismatch(saved_workload(tree, config), workload)
    if other is not None:
        return other
    saved, by_name = saved_method(tree, config)
    mine = method if by_name else config_method
    if saved is not None and saved != mine:
        switch = _SWITCH_OF.get(mine) or _SWITCH_OF.get(saved) or "resume_from"
        return Mismatch(switch, _with(saved), _with(mine))
    kinds = saved_optimizers(tree, config)
    if kinds and optimizer not in kinds:
        flag = OPTIONS["optimizer"].flag
        return Mismatch("optimizer", f"{flag} {' or '.join(sorted(kinds))}", f"{flag} {optimizer}")
    return None
