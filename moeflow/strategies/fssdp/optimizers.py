"""Which optimizers FSSDP's slot storage keeps correct, checked at every optimizer's first step.

HECATE (Section 3.1) gives each expert's parameters and optimizer state one owner. moeflow
stores a rank's owned experts as the rows of one ``nn.Parameter`` (``slots: (S, numel)``,
shared by every MoE layer once Algorithm 2 re-shards, Section 4.3), so an optimizer sees one
tensor where there are S experts. An optimizer whose update is elementwise (SGD, Adam, AdamW,
...) computes exactly what it would on separate experts, and its state tensors have the slot
tensor's shape, which re-sharding moves row by row. An optimizer that reduces over a tensor
(Adafactor's row and column statistics, LAMB's or LARS's trust ratios, Shampoo's
preconditioners, Muon's orthogonalisation, L-BFGS's global direction) would mix experts, and its
state would not move with them; such optimizers are refused with a ``ConfigError`` before their
first step touches a slot tensor.

The check runs as a global ``torch.optim`` step pre-hook (installed when the first slot tensor
is made), once per optimizer (again after ``add_param_group``), so it covers optimizers that
users build themselves. Declare a custom elementwise optimizer with
:func:`elementwise_optimizer`.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from moeflow.errors import ConfigError

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_optimizer", "elementwise_optimizer", "mark_slots"]

#: torch.optim classes whose update and state are per element (ASGD's eta / mu are per-group
#: scalars of the step count, the same for every element)
ELEMENTWISE_OPTIMIZERS: set[type] = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
}

SLOTS_ATTR = "_moeflow_fssdp_slots"
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_hook = None


def elementwise_optimizer(cls: type) -> type:
    """Declare ``cls`` (a ``torch.optim.Optimizer`` subclass) elementwise: its update of every
    element depends on that element's gradient and state only. Usable as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"elementwise_optimizer({cls!r}): pass a torch.optim.Optimizer "
                        "subclass")
    ELEMENTWISE_OPTIMIZERS.add(cls)
    return cls


def mark_slots(param: torch.Tensor) -> None:
    """Record an FSSDP slot tensor, and install the step pre-hook once per process."""
    global _hook
    setattr(param, SLOTS_ATTR, True)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_pre_step)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """ConfigError if ``optimizer`` holds an FSSDP slot tensor and is not elementwise."""
    cls = type(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS:
        return
    if not any(getattr(p, SLOTS_ATTR, False) for g in optimizer.param_groups
               for p in g["params"]):
        return
    raise ConfigError(
        f"{cls.__module__}.{cls.__qualname__} cannot step FSSDP experts "
        "(MoEConfig.placement='fssdp'): every owned expert of a rank is a row of one slot "
        "tensor, and this optimizer's update is not declared elementwise, so it would mix "
        "experts (as Adafactor's row/column statistics or LAMB/LARS trust ratios do) and its "
        "state would not follow re-sharding. Use an elementwise optimizer (SGD, Adam, AdamW, "
        "Adamax, NAdam, RAdam, RMSprop, Adagrad, ...), or placement='ep'; if its update is per "
        "element, declare it with moeflow.strategies.fssdp.optimizers.elementwise_optimizer"
        f"({cls.__qualname__})")


def _pre_step(optimizer, args, kwargs) -> None:
    groups = len(optimizer.param_groups)
    if _checked.get(optimizer) == groups:
        return
    check_optimizer(optimizer)
    _checked[optimizer] = groups
