"""transformers MoE blocks <-> moeflow layers, whole models, and state dicts (docs/hf.md).

Under expert parallelism each rank's layer holds the experts ``ep_rank * E_local ..``; reading
from a transformers block takes that slice by global expert id, and writing back (``to_hf``,
``hf_state_dict``, ``save_pretrained``) first all-gathers the stacked expert tensors over the
expert-parallel group, in global expert order. Those calls are collective when
``topo.ep_size > 1``: every rank makes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.errors import ConfigError
from moeflow.integrations.hf.architectures import (Architecture, architecture_of,
                                                   block_config, hf_from_moeflow,
                                                   moeflow_from_hf)
from moeflow.integrations.hf.recipes import moe_config_from_hf
from moeflow.routing.aux_grad import missing_aux_grad


def _arch(block) -> Architecture:
    arch = architecture_of(block)
    if arch is None:
        from moeflow.integrations.hf.architectures import ARCHITECTURES

        raise ConfigError(f"from_hf: {type(block).__name__} is not a supported transformers "
                          f"MoE block; supported: {', '.join(sorted(ARCHITECTURES))}")
    return arch


def from_hf(block: nn.Module, topo=None, config=None, layer_id: int = 0,
            attach_aux_loss: bool = False, **overrides):
    """The :class:`~moeflow.MoELayer` computing what the transformers ``block`` computes, with
    its weights (this rank's experts under expert parallelism), dtype and device.

    ``config`` (the model's transformers config) sets the balancing-loss scale and DeepSeek-V3's
    bias-update speed as :func:`moe_config_from_hf` does; ``overrides`` set further MoEConfig
    fields (codec, a2a, schedule, pipeline_degree, aux_loss_coef, ...).
    ``attach_aux_loss``: see :class:`~moeflow.MoELayer` and ``replace_moe_blocks``.
    """
    from moeflow.config import MoEConfig
    from moeflow.layer import MoELayer

    arch = _arch(block)
    kw = block_config(block, arch)
    if config is not None:
        recipe = moe_config_from_hf(config, layer_id)
        kw["aux_loss_coef"] = recipe.aux_loss_coef
        if arch.model_type == "deepseek_v3":
            kw["router_options"]["bias_update_speed"] = \
                recipe.router_options["bias_update_speed"]
    layer = MoELayer(MoEConfig(**{**kw, "layer_id": layer_id, **overrides}), topo,
                     attach_aux_loss=attach_aux_loss)
    ref = next(block.parameters())
    layer.to(device=ref.device, dtype=ref.dtype)
    if arch.model_type == "deepseek_v3":      # the bias stays in the block's buffer dtype
        layer.router.e_score_correction_bias.data = \
            layer.router.e_score_correction_bias.to(block.gate.e_score_correction_bias.dtype)
    _load_block(layer, arch, block.state_dict())
    return layer


def _check_layout(layer) -> None:
    if layer.topo.esp_size > 1:
        raise ConfigError("Hugging Face conversion of experts sharded over ESP ranks (Parm, "
                          f"esp_size={layer.topo.esp_size}) is not implemented; use esp_size=1")


def _load_block(layer, arch: Architecture, block_sd: dict) -> None:
    _check_layout(layer)
    sd = moeflow_from_hf(arch, block_sd, layer.experts.first_expert, layer.num_local)
    layer.load_state_dict(sd, strict=True)


def full_layer_state(layer) -> dict:
    """The layer's state dict with every expert (all-gathered over the EP group, in global
    expert order; collective when ``ep_size > 1``)."""
    _check_layout(layer)
    sd = {k: v.detach() for k, v in layer.state_dict().items()}
    topo = layer.topo
    if topo.ep_size == 1:
        return sd
    for k in sorted(k for k in sd if k.startswith("experts.")):
        t = sd[k].contiguous()
        parts = [torch.empty_like(t) for _ in range(topo.ep_size)]
        dist.all_gather(parts, t, group=topo.ep_group)
        sd[k] = torch.cat(parts)
    return sd


def to_hf(layer, block: nn.Module) -> nn.Module:
    """Write ``layer``'s weights into the transformers ``block`` (all experts; collective
    under expert parallelism); returns the block."""
    arch = _arch(block)
    hf = hf_from_moeflow(arch, full_layer_state(layer))
    block.load_state_dict(hf, strict=True)
    return block


class HFMoEBlock(nn.Module):
    """A moeflow layer in the place of a transformers MoE block (same call and return:
    GPT-OSS's block returns ``(hidden_states, router_scores)``; here the scores are None)."""

    def __init__(self, layer, arch: Architecture):
        super().__init__()
        self.moe = layer
        self.arch = arch

    def forward(self, hidden_states: torch.Tensor):
        y = self.moe(hidden_states)
        return (y, None) if self.arch.returns_router_scores else y

    def extra_repr(self) -> str:
        return f"replaces {self.arch.block}"


AUX_LOSS_MODES = ("collect", "attach")


class AuxLosses:
    """The swapped layers' auxiliary losses (each already carries the recipe's coefficient).

    ``aux_loss="collect"``: ``aux()`` after a forward is their sum; add it to the language-model
    loss. It refuses (RuntimeError) when the layers' losses were computed without autograd in
    training, which is what reentrant activation checkpointing does: the router would silently
    get no balancing gradient. ``aux_loss="attach"``: the layers back-propagate their losses
    through their outputs (moeflow/routing/aux_grad.py), so the model's own loss trains the
    routers under any checkpointing; ``aux()`` then refuses (adding it would count the losses
    twice). In both modes ``value()`` is the detached sum, for logging.
    """

    def __init__(self, layers: list, mode: str = "collect"):
        self.layers = layers
        self.mode = mode

    def __call__(self) -> torch.Tensor:
        if self.mode == "attach":
            raise RuntimeError(
                "aux(): the layers were swapped with aux_loss='attach': their aux losses are "
                "already back-propagated through the layer outputs, so adding aux() to the loss "
                "would count them twice; use the model's loss alone (aux.value() logs them)")
        missing = missing_aux_grad(self.layers)
        if missing and torch.is_grad_enabled():
            raise RuntimeError(
                f"aux(): the aux losses of MoE layers {missing} were computed without autograd "
                "in training mode, so adding them to the loss would train no router. This is "
                "what reentrant activation checkpointing does (use_reentrant=True: the "
                "checkpointed forward runs under no_grad and is recomputed in backward). Swap "
                "with replace_moe_blocks(..., aux_loss='attach') (works with any "
                "checkpointing), or checkpoint with use_reentrant=False; to only log the "
                "value, use aux.value()")
        return self._sum()

    def value(self) -> torch.Tensor:
        """The detached sum of the last forward's aux losses (logging, either mode)."""
        return self._sum().detach()

    def set_backward_scale(self, scale: float) -> None:
        """``aux_loss='attach'``: the gradient fed to each aux loss, i.e. the factor applied to
        the loss before ``backward`` (``1 / accumulation_steps``, an AMP loss scale); 1 by
        default."""
        for layer in self.layers:
            layer.aux_loss_backward_scale = float(scale)

    def _sum(self) -> torch.Tensor:
        losses = [layer.aux_loss for layer in self.layers if layer.aux_loss is not None]
        if not losses:
            raise RuntimeError("no auxiliary loss yet: run a forward of the model first")
        return torch.stack(losses).sum()

    def __len__(self) -> int:
        return len(self.layers)


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every HFMoEBlock of a swapped model, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]


def replace_moe_blocks(model: nn.Module, topo=None, aux_loss: str = "collect",
                       **overrides) -> AuxLosses:
    """Swap every transformers MoE block of ``model`` for an :class:`HFMoEBlock` (in place),
    with the weights mapped exactly; returns the collector of their aux losses.

    ``aux_loss``: ``"collect"`` (add ``aux()`` to the loss yourself) or ``"attach"`` (the
    layers back-propagate their aux losses through their outputs: the model's own loss, e.g.
    in ``transformers.Trainer``, trains the routers, also under reentrant gradient
    checkpointing; do not add ``aux()``). See :class:`AuxLosses`.

    The i-th MoE block becomes the layer with ``layer_id=i``. ``model.config.
    output_router_logits`` is set to False: moeflow computes the balancing loss in each
    layer (``aux()``), and transformers' own loss would find no router logits to pool.
    """
    if aux_loss not in AUX_LOSS_MODES:
        raise ConfigError(f"replace_moe_blocks: aux_loss={aux_loss!r} is invalid: choose "
                          "'collect' (add aux() to the loss) or 'attach' (back-propagated "
                          "through the layer outputs; needed with reentrant checkpointing)")
    config = getattr(model, "config", None)
    layers = []
    for name, module in list(model.named_modules()):
        arch = architecture_of(module)
        if arch is None:
            continue
        layer = from_hf(module, topo, config=config, layer_id=len(layers),
                        attach_aux_loss=aux_loss == "attach", **overrides)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                HFMoEBlock(layer, arch).train(module.training))   # keep train / eval mode
        layers.append(layer)
    if not layers:
        raise ConfigError(f"replace_moe_blocks: {type(model).__name__} has no supported MoE "
                          "block")
    if config is not None and getattr(config, "output_router_logits", False):
        config.output_router_logits = False
    return AuxLosses(layers, aux_loss)


def hf_state_dict(model: nn.Module) -> dict:
    """The swapped ``model``'s state dict with the original class's keys and layouts (every
    expert, gathered by global expert id: collective under expert parallelism)."""
    out = {}
    blocks = moe_blocks(model)
    prefixes = tuple(f"{n}." for n, _ in blocks)
    for k, v in model.state_dict().items():
        if not k.startswith(prefixes):
            out[k] = v
    for name, block in blocks:
        for k, v in hf_from_moeflow(block.arch, full_layer_state(block.moe)).items():
            out[f"{name}.{k}"] = v
    return out


def load_hf_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a state dict in the original class's keys (a transformers checkpoint) into the
    swapped ``model``; each rank takes its experts by global expert id."""
    blocks = moe_blocks(model)
    prefixes = tuple(f"{n}." for n, _ in blocks)
    mapped = {k: v for k, v in state_dict.items() if not k.startswith(prefixes)}
    for name, block in blocks:
        p = f"{name}."
        sub = {k[len(p):]: v for k, v in state_dict.items() if k.startswith(p)}
        _check_layout(block.moe)
        layer_sd = moeflow_from_hf(block.arch, sub, block.moe.experts.first_expert,
                                   block.moe.num_local)
        mapped.update({f"{p}moe.{k}": v for k, v in layer_sd.items()})
    return model.load_state_dict(mapped, strict=strict)


def save_pretrained(model: nn.Module, save_directory: str, topo=None, **kwargs) -> None:
    """Save the swapped ``model`` as a checkpoint of its original transformers class
    (``type(model).from_pretrained(save_directory)`` loads it). Collective under expert
    parallelism (every rank calls it); rank 0 writes."""
    sd = hf_state_dict(model)
    if topo is not None and topo.rank != 0:
        return
    original = type(model)(model.config).to(next(model.parameters()).dtype)
    original.load_state_dict(sd, strict=True)
    original.save_pretrained(save_directory, **kwargs)
