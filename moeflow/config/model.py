"""``ModelConfig`` (alias ``GPTConfig``): the GPT of ``moeflow train``, whose MoE blocks are one
nested :class:`~moeflow.config.moe.MoEConfig` (``moe``), the one spelling of every MoE field
(GShard's every-other-block MoE layout, ``moe_every``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeflow.config.validation import _positive_int, _require, config_error
from moeflow.config.moe import MoEConfig
from moeflow.errors import ConfigError
from moeflow.registry import did_you_mean

# What a ModelConfig's MoE blocks are unless ``moe`` says otherwise (a MoEConfig has no default
# size; these are the "tiny" preset's).
MODEL_MOE_DEFAULTS = {"num_experts": 8, "d_expert": 256}
# MoEConfig fields the model fills in for every MoE block: its width and weight seed are the
# model's, its layer_id is the block index (see ModelConfig.moe_config).
MODEL_OWNED_MOE_FIELDS = ("d_model", "seed", "layer_id")


@dataclass
class ModelConfig:
    """A small GPT whose FFN is an MoE layer every ``moe_every`` blocks (the others are dense).

    The model's own sizes are fields of this class; everything about its MoE blocks is one
    :class:`MoEConfig`, ``moe``, the template of every MoE block (as nanoGPT and torchtitan keep
    a model's parts)::

        ModelConfig(d_model=128, n_layers=4, moe=MoEConfig(d_model=128, d_expert=256,
                                                             num_experts=8, top_k=1))

    ``moe`` may also be a dict of MoEConfig fields (``moe={"top_k": 1}``: what ``moeflow train
    --set moe.top_k=1`` and a run's ``config.json`` give), laid over ``num_experts=8,
    d_expert=256``; it is stored as a MoEConfig either way.

    Three MoEConfig fields are the model's (:data:`MODEL_OWNED_MOE_FIELDS`): ``moe.d_model`` must
    equal ``d_model`` (a dict may leave it out); ``moe.seed`` is ``seed`` (left at 0 it takes the
    model's, any other value must equal it); ``moe.layer_id`` is set per block by
    :meth:`moe_config`. A MoE field given flat (``ModelConfig(top_k=1)``) is refused with a
    ConfigError naming ``moe.top_k``. :meth:`replace` changes model and MoE fields at once
    (``cfg.replace(d_model=64, moe={"top_k": 1})``), keeping the MoE's width and seed the
    model's.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    moe_every: int = 1
    dropout: float = 0.0
    seed: int = 0          # every weight's seed: the dense blocks' and (as moe.seed) the MoE's
    moe: "MoEConfig | dict | None" = None     # None: MoEConfig(**MODEL_MOE_DEFAULTS)

    # the sections `--set SECTION.FIELD=VALUE` reaches (moeflow.commands.common.parse_overrides)
    NESTED = {"moe": MoEConfig}

    def __new__(cls, *args, **kwargs):
        check_model_field_names("ModelConfig", kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        o = "ModelConfig"
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff",
                     "moe_every"):
            _positive_int(o, name, getattr(self, name))
        _require(self.d_model % self.n_heads == 0, o, "n_heads", self.n_heads,
                 f"must divide d_model ({self.d_model})")
        _require(0.0 <= self.dropout < 1.0, o, "dropout", self.dropout, "must be in [0, 1)")
        _require(isinstance(self.seed, int) and not isinstance(self.seed, bool)
                 and self.seed >= 0, o, "seed", self.seed, "must be a non-negative integer")
        self.moe = self._moe_template(self.moe)

    def _moe_template(self, moe) -> MoEConfig:
        """``moe`` as the MoEConfig of every MoE block, its model-owned fields checked."""
        o = "ModelConfig"
        if moe is None:
            moe = {}
        if isinstance(moe, dict):
            check_moe_field_names(moe)
            moe = MoEConfig(**{"d_model": self.d_model, "seed": self.seed,
                               **MODEL_MOE_DEFAULTS, **moe})
        _require(isinstance(moe, MoEConfig), o, "moe", moe,
                 "must be a MoEConfig (the template of every MoE block) or a dict of "
                 "MoEConfig fields, e.g. {'top_k': 1, 'capacity_padding': 'pad'}")
        _require(moe.d_model == self.d_model, o, "moe.d_model", moe.d_model,
                 f"must equal ModelConfig.d_model={self.d_model} (the MoE blocks take the "
                 "model's width): build the MoEConfig with the same d_model, or leave it out "
                 "of a moe dict")
        _require(moe.seed in (0, self.seed), o, "moe.seed", moe.seed,
                 f"contradicts ModelConfig.seed={self.seed}: the model's seed seeds its MoE "
                 "blocks; set ModelConfig.seed (--set seed=N) and leave moe.seed at 0")
        _require(moe.layer_id == 0, o, "moe.layer_id", moe.layer_id,
                 "the model sets it (the block index); leave it at 0")
        return moe if moe.seed == self.seed else moe.replace(seed=self.seed)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes``: model fields, and ``moe`` as a dict of MoEConfig fields to
        change (or a whole MoEConfig). The MoE's ``d_model`` and ``seed`` follow the model's."""
        check_model_field_names("ModelConfig", changes)
        moe = changes.pop("moe", None)
        if not isinstance(moe, MoEConfig):
            _require(moe is None or isinstance(moe, dict), "ModelConfig", "moe", moe,
                     "must be a dict of MoEConfig fields to change, or a MoEConfig")
            check_moe_field_names(moe or {})
            owned = {"d_model": changes.get("d_model", self.d_model),
                     "seed": changes.get("seed", self.seed)}
            moe = self.moe.replace(**{**owned, **(moe or {})})
        return dataclasses.replace(self, moe=moe, **changes)

    @classmethod
    def from_dict(cls, saved: dict, source: str) -> "ModelConfig":
        """The config a run folder's ``config.json`` keeps under ``"model"``
        (``dataclasses.asdict``: ``moe`` nested). The flat form of older runs (MoE fields
        beside ``moe``) is refused, naming the fields to move under ``"moe"``."""
        flat = sorted(k for k in saved if k in _moe_field_names() and k not in _model_fields())
        if flat:
            raise ConfigError(
                f"{source}: the model config is in the old flat form (MoE fields "
                f"{', '.join(flat)} beside 'moe'); move them into its 'moe' entry "
                f"(\"moe\": {{\"{flat[0]}\": ...}}), as moeflow now writes it, or rerun "
                "the command that made it")
        return cls(**saved)

    def is_moe(self, block: int) -> bool:
        """Blocks moe_every-1, 2*moe_every-1, ... are MoE (GShard: every other block for 2)."""
        return (block + 1) % self.moe_every == 0

    def moe_layer_ids(self) -> list[int]:
        return [b for b in range(self.n_layers) if self.is_moe(b)]

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids())

    def moe_config(self, block: int) -> MoEConfig:
        """Block ``block``'s MoEConfig: the template with ``layer_id=block``."""
        return self.moe.replace(layer_id=block)


def config_differences(saved: ModelConfig, now: ModelConfig) -> dict[str, tuple]:
    """``{field: (saved, now)}`` where two model configs differ, MoE fields as ``moe.FIELD``
    (values as JSON keeps them)."""
    import json

    def flat(cfg: ModelConfig) -> dict:
        d = json.loads(json.dumps(dataclasses.asdict(cfg)))
        return {**{k: v for k, v in d.items() if k != "moe"},
                **{f"moe.{k}": v for k, v in d["moe"].items()}}

    a, b = flat(saved), flat(now)
    return {k: (a.get(k), v) for k, v in b.items() if a.get(k) != v}


def _moe_field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(MoEConfig)]


def _model_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]


def check_moe_field_names(moe: dict) -> None:
    """Every key of a ``moe`` dict is a MoEConfig field (with a did-you-mean)."""
    names = _moe_field_names()
    for key in moe:
        if key not in names:
            raise config_error("ModelConfig", f"moe.{key}", moe[key],
                               f"not a MoEConfig field{did_you_mean(key, names)}")


def check_model_field_names(owner: str, given: dict) -> None:
    """Every key is a ModelConfig field; a MoEConfig field given flat names ``moe.FIELD``."""
    mine = _model_fields()
    for key in given:
        if key in mine:
            continue
        if key in _moe_field_names():
            raise config_error(owner, key, given[key],
                               f"{key} is a MoEConfig field: set it as moe.{key} "
                               f"(moe=MoEConfig(..., {key}=...) or moe={{'{key}': ...}}; "
                               f"on the command line --set moe.{key}=...)")
        hint = (did_you_mean(key, mine)
                or did_you_mean(key, _moe_field_names()).replace(" '", " 'moe."))
        raise config_error(owner, key, given[key], f"not a ModelConfig field{hint}")


GPTConfig = ModelConfig
"""The model's config under the name nanoGPT and torchtitan users look for:
``GPTConfig(..., moe=MoEConfig(...))``."""
