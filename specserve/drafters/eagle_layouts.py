"""Which layout an EAGLE head directory is in, and loading it unchanged: specserve's own, EAGLE-1/2 and EAGLE-3.

The layout is read from the directory itself, with no conversion step (docs/published-heads.md):

* ``"specserve_drafter": "eagle"`` in ``config.json``: specserve's own head (:meth:`EagleHead.load`);
* tensors named ``midlayer.*`` (SafeAILab, SGLang), or ``layers.0.self_attn.q_proj`` reading 2H, or an
  ``*Eagle3*`` architecture: an **EAGLE-3** head (:mod:`specserve.drafters.eagle3`);
* ``fc.weight`` ``[H, 2H]`` beside ``layers.*``: an **EAGLE-1/EAGLE-2** head (SafeAILab ``cnets1.py``: ``fc`` with a
  bias unless the config says ``"bias": false``, no input norm on layer 0, no final norm, the target's LM head).

A published head's ``embed_tokens`` is not used when the head is as wide as the target (the reference overwrites it
with the target's); an EAGLE-3 head narrower than its target must carry one. Which target layers an EAGLE-3 head
reads: ``eagle_aux_hidden_state_layer_ids`` (at the top level or in ``eagle_config``) or the reference's default
(2, L // 2, L - 3), each id j meaning the *input* of layer j (``hidden_states[j]``, vLLM's reading); a list whose first
id is 1 is read as *outputs* of layers and shifted by one, as SGLang does. Every tensor is checked by name and shape
before anything loads; a missing, extra or misshapen tensor is refused in one line naming it.

The ``speculators`` format (vLLM's; ``speculators_model_type``) loads for ``eagle3`` and ``eagle``: the decoder's
fields come from ``transformer_layer_config``, the EAGLE-3 ones from the top level; ``norm_before_residual`` defaults
to true there (vLLM's reading of that format) and to false in a plain config (the reference's behaviour); an ``eagle``
head is EAGLE-1's under other names (``fusion_fc.*``, ``transformer.*``), refused with HASS's extra norms
(``layernorms: true``); the verifier it names (``speculators_config.verifier``: architectures, and the name when the
target has a directory) must be the target; ``proposal_methods[0].speculative_tokens`` becomes the head's suggested
γ. Other speculators types are refused.

Does not load Medusa or MTP heads, or check a head's shapes against its target
(:func:`~specserve.drafters.eagle_head.check_head_fits`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from specserve.core.draft.spec_strings import speculative_tokens
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.drafters.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from specserve.drafters.eagle_head import KIND, TRAIN_HINT, EagleConfig, EagleHead, EagleLoadError, FeatureHead
from specserve.drafters.head_files import CONFIG_FILE, read_config_json, read_weights

ROPE_TYPES = ("default", "linear", "dynamic")
# published tensor-name prefix -> the module's; the first pair of a module prefix is the one messages use
EAGLE1_NAMES = (("layers.", "body.layers."), ("fc.", "fc."))
EAGLE3_NAMES = (
    ("midlayer.", "body.layers.0."),
    ("layers.0.", "body.layers.0."),  # vLLM's and speculators' name for the midlayer
    ("fc.", "fc."),
    ("norm.", "norm."),
    ("lm_head.", "lm_head."),
    ("embed_tokens.", "embed_tokens."),
    ("d2t", "d2t"),
    ("t2d", "t2d"),
    ("input_norm.", "input_norm."),  # norm_before_fc
    ("fc_norm.", "fc_norm."),  # fc_norm
)
SPECULATORS_EAGLE_NAMES = (("transformer.", "body.layers.0."), ("fusion_fc.", "fc."))  # speculators "eagle"
SPECULATORS_TYPES = ("eagle3", "eagle")
# the EAGLE-3 fields a speculators config keeps at its top level (the decoder's are in transformer_layer_config)
EAGLE3_FIELDS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
)


def load_head(directory: str | Path, target: CausalLM) -> FeatureHead:
    """The EAGLE head in ``directory``, whatever its layout, for ``target`` (published heads name the target layers
    they read relative to its depth, and speculators heads name their verifier)."""
    path = Path(directory)
    config = read_config_json(path, "an EAGLE head", EagleLoadError, TRAIN_HINT)
    if "specserve_drafter" in config:
        return EagleHead.load(path)  # specserve's own (or another kind of specserve head: refused there)
    num_layers = int(target.model.config.num_hidden_layers)
    if "speculators_model_type" in config:
        return load_speculators(path, config, _strip_model_prefix(read_weights(path, EagleLoadError)), target)
    state = _strip_model_prefix(read_weights(path, EagleLoadError))
    architectures = " ".join(str(name) for name in config.get("architectures") or [])
    hidden = config.get("hidden_size")
    q_proj = state.get("layers.0.self_attn.q_proj.weight")
    wide_attention = q_proj is not None and isinstance(hidden, int) and q_proj.shape[-1] == 2 * hidden
    if any(name.startswith("midlayer.") for name in state) or "Eagle3" in architectures or wide_attention:
        return load_eagle3(path, config, state, num_layers)
    if "fc.weight" in state and any(name.startswith("layers.") for name in state):
        return load_eagle1(path, config, state, num_layers)
    shown = ", ".join(sorted(state)[:4]) + (", ..." if len(state) > 4 else "")
    raise EagleLoadError(
        f"{path} is not an EAGLE head directory: its tensors ({shown}) are neither an EAGLE-1/2 head (fc, layers.*) "
        f'nor an EAGLE-3 head (fc, midlayer.*, lm_head), and its {CONFIG_FILE} lacks "specserve_drafter": "{KIND}"; '
        f"{TRAIN_HINT}"
    )


def load_eagle1(path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor], num_layers: int) -> EagleHead:
    """A SafeAILab EAGLE-1/2 head (docs/published-heads.md §1): it reads the target's top feature, after the final
    norm (``hidden_states[L]``)."""
    fields = _llama_fields(path, config)
    fields.pop("head_dim")  # cnets1.py computes hidden / heads and does not read head_dim
    head_config = EagleConfig(
        feature_layers=(num_layers,),
        num_hidden_layers=_int(path, config, "num_hidden_layers", 1),
        fc_bias=bool(config.get("bias", True)),  # absent means a bias (the Vicuna / LLaMA-2 heads)
        first_input_norm=False,
        final_norm=False,
        qkv_bias=bool(config.get("qkv_bias", False)),
        **fields,
    )
    head = EagleHead(head_config)
    _load_exactly(head, state, EAGLE1_NAMES, path, optional=("embed_tokens.weight",), unused=("embed_tokens.weight",))
    return head.eval()


def load_speculators(
    path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor], target: CausalLM
) -> FeatureHead:
    """A head in vLLM's speculators format (docs/published-heads.md §3)."""
    kind = config.get("speculators_model_type")
    if kind not in SPECULATORS_TYPES:
        raise EagleLoadError(
            f"{path} is a speculators {kind!r} head; specserve loads speculators {', '.join(SPECULATORS_TYPES)} heads"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EagleLoadError(f"{path}/{CONFIG_FILE} lacks transformer_layer_config, which a speculators head has")
    settings = _section(config, "speculators_config")
    verifier = _section(settings, "verifier")
    check_verifier(path, verifier, target)
    num_layers = int(target.model.config.num_hidden_layers)
    head: FeatureHead
    if kind == "eagle":
        head = load_speculators_eagle(path, config, layer, state, num_layers)
    else:
        flat = {**layer, **{key: config[key] for key in EAGLE3_FIELDS if key in config}}
        head = load_eagle3(path, flat, state, num_layers, speculators=True)
    head.speculative_tokens = speculative_tokens(config)
    return head


def load_speculators_eagle(
    path: Path, config: Mapping[str, Any], layer: Mapping[str, Any], state: Mapping[str, torch.Tensor], num_layers: int
) -> EagleHead:
    """A speculators ``eagle`` head (docs/published-heads.md §3.3): EAGLE-1's head, ``fc`` named ``fusion_fc`` and its
    layer ``transformer``, reading the target's top feature after the final norm; HASS's extra norms are refused."""
    if config.get("layernorms"):
        raise EagleLoadError(
            f"{path} is a speculators eagle head with HASS's extra norms (layernorms: true); specserve loads that "
            "format without them only"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if layer.get(flag):
            raise EagleLoadError(f"{path}: its transformer_layer_config sets {flag}, which EAGLE heads here lack")
    head_config = EagleConfig(
        feature_layers=(num_layers,),
        fc_bias="fusion_fc.bias" in state,
        first_input_norm=False,
        final_norm=False,
        **_llama_fields(path, layer),
    )
    head = EagleHead(head_config)
    _load_exactly(head, state, SPECULATORS_EAGLE_NAMES, path)
    return head.eval()


def check_verifier(path: Path, verifier: Mapping[str, Any], target: CausalLM) -> None:
    """Refuse a speculators head whose verifier is not ``target``: by architecture, and by name when the target was
    loaded from a directory (the name's last component against the directory's or the config's ``_name_or_path``)."""
    name = str(verifier.get("name_or_path") or "")
    wanted = [str(a) for a in verifier.get("architectures") or []]
    have = [str(a) for a in getattr(target.model.config, "architectures", None) or [target.info.architecture]]
    if wanted and not set(wanted) & set(have):
        raise EagleLoadError(
            f"{path} is a head for a {'/'.join(wanted)} verifier ({name or 'unnamed'}); this target is a "
            f"{'/'.join(have)}: use a head published for this target's model"
        )
    if not name or target.info.path.startswith("<"):
        return
    last = name.rstrip("/").split("/")[-1].lower()
    known = {
        Path(target.info.path).name.lower(),
        str(getattr(target.model.config, "_name_or_path", "") or "").rstrip("/").split("/")[-1].lower(),
    }
    if last not in known:
        raise EagleLoadError(
            f"{path} is a head for {name} (speculators_config.verifier.name_or_path), not for {target.info.path}: use "
            f"a head published for this target's model (or, if this target is {name}, name its directory {last})"
        )


def load_eagle3(
    path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor], num_layers: int, speculators: bool = False
) -> Eagle3Head:
    """A SafeAILab/SGLang EAGLE-3 head (docs/published-heads.md §2), midlayer named ``midlayer.`` or ``layers.0.``;
    ``speculators``: the fields of a speculators config, whose defaults differ (a residual after hidden_norm, a bias on
    fc exactly when the file has one)."""
    fields = _llama_fields(path, config)
    layers = _int(path, config, "num_hidden_layers", 1)
    if layers != 1:
        raise EagleLoadError(f"{path} is an EAGLE-3 head of {layers} layers; specserve loads single-layer heads only")
    hidden = fields["hidden_size"]
    target_hidden = _int(path, config, "target_hidden_size", hidden)
    vocab = fields["vocab_size"]
    draft_vocab = _int(path, config, "draft_vocab_size", vocab)
    nested = _section(config, "eagle_config")

    def setting(key: str, default: Any = None) -> Any:  # at the top level, or in eagle_config (vLLM reads both)
        return config[key] if config.get(key) is not None else nested.get(key, default)

    if setting("norm_before_fc") and setting("fc_norm"):
        raise EagleLoadError(f"{path}/{CONFIG_FILE} sets both norm_before_fc and fc_norm; a head has one or neither")
    head_config = Eagle3Config(
        feature_layers=aux_feature_layers(setting("eagle_aux_hidden_state_layer_ids"), num_layers, path),
        target_hidden_size=target_hidden,
        draft_vocab_size=draft_vocab,
        norm_before_residual=bool(setting("norm_before_residual", speculators)),
        fc_bias=("fc.bias" in state) if speculators else bool(config.get("bias", False)),
        norm_before_fc=bool(setting("norm_before_fc", False)),
        fc_norm=bool(setting("fc_norm", False)),
        norm_output=bool(setting("norm_output", False)),
        own_embeddings=target_hidden != hidden,
        **fields,
    )
    head = Eagle3Head(head_config)
    reduced = draft_vocab != vocab
    optional = ["t2d"] + ([] if reduced else ["d2t"]) + ([] if head_config.own_embeddings else ["embed_tokens.weight"])
    unused = () if head_config.own_embeddings else ("embed_tokens.weight",)
    _load_exactly(head, state, EAGLE3_NAMES, path, optional=tuple(optional), unused=unused)
    if reduced:
        ids = head.draft_token_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft_vocab:
            raise EagleLoadError(
                f"{path}: d2t maps the {draft_vocab} draft tokens outside the {vocab}-token vocabulary or onto "
                "one token twice"
            )
    return head.eval()


def aux_feature_layers(ids: Sequence[int] | None, num_layers: int, path: Path | str = "") -> tuple[int, ...]:
    """The ``hidden_states`` indices of the target features an EAGLE-3 head reads: the inputs of layers ``ids``
    (default 2, L // 2, L - 3); a list starting at 1 names layer outputs and is shifted by one (SGLang's reading)."""
    if ids is None:
        try:
            return default_aux_layers(num_layers)
        except UserError as exc:
            raise EagleLoadError(f"{path}: {exc}") from exc
    if not isinstance(ids, list | tuple) or not ids or not all(isinstance(i, int) for i in ids):
        raise EagleLoadError(f"{path}: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}")
    layers = tuple(i + 1 for i in ids) if ids[0] == 1 else tuple(ids)
    if any(not 0 <= layer < num_layers for layer in layers):
        raise EagleLoadError(
            f"{path}: the head reads the inputs of target layers {list(layers)}, but this target's layers are "
            f"0..{num_layers - 1}: it was trained for a deeper target"
        )
    return layers


def _section(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A nested object of a config (``{}`` when it is absent or not an object)."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _strip_model_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SGLang/SpecForge save some heads with every name under ``model.``: read them as the reference names."""
    if state and all(name.startswith("model.") for name in state):
        return {name[len("model.") :]: tensor for name, tensor in state.items()}
    return state


def _int(path: Path, config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise EagleLoadError(f"{path}/{CONFIG_FILE} lacks {key!r}, which this head needs")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EagleLoadError(f"{path}/{CONFIG_FILE}: {key!r} must be a positive integer, got {value!r}")
    return value


def _llama_fields(path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """The Llama fields every published EAGLE head's config has, as the head configs' keyword arguments."""
    heads = _int(path, config, "num_attention_heads")
    rope, scaling = _section(config, "rope_parameters"), _section(config, "rope_scaling")
    rope_type = str(scaling.get("rope_type") or scaling.get("type") or rope.get("rope_type") or "default")
    if rope_type not in ROPE_TYPES:
        raise EagleLoadError(
            f"{path}/{CONFIG_FILE}: rope scaling {rope_type!r} is not supported for EAGLE heads "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    return {
        "hidden_size": _int(path, config, "hidden_size"),
        "vocab_size": _int(path, config, "vocab_size"),
        "intermediate_size": _int(path, config, "intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(path, config, "num_key_value_heads", heads),
        "head_dim": int(config.get("head_dim") or 0),
        "max_position_embeddings": _int(path, config, "max_position_embeddings", 2048),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "rope_type": rope_type,
        "rope_factor": float(scaling.get("factor") or rope.get("factor") or 1.0),
    }


def _load_exactly(
    head: FeatureHead,
    state: Mapping[str, torch.Tensor],
    names: Sequence[tuple[str, str]],
    path: Path,
    optional: Sequence[str] = (),
    unused: Sequence[str] = (),
) -> None:
    """Load the published ``state`` into ``head`` after checking every tensor by name and shape (``optional``
    published names may be absent, ``unused`` ones are read past); one line names whatever does not match."""

    def to_module(name: str) -> str | None:
        for published, module in names:
            if name.startswith(published):
                return module + name[len(published) :]
        return None

    spelled: dict[str, str] = {}  # module prefix -> the published prefix messages use: the file's own spelling
    for published, module in names:
        if module not in spelled or any(name.startswith(published) for name in state):
            spelled[module] = published

    def to_published(name: str) -> str:
        for module, published in spelled.items():
            if name.startswith(module):
                return published + name[len(module) :]
        return name

    own = {name: tensor for name, tensor in head.state_dict().items() if name != "body.embed_tokens.weight"}
    expected = {to_published(name): tensor for name, tensor in own.items()}
    given = {name: tensor for name, tensor in state.items() if name not in unused}
    problems = []
    missing = sorted(set(expected) - set(given) - set(optional))
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    unexpected = sorted(name for name in given if name not in expected and to_module(name) not in own)
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)}")
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in given.items():
        module_name = to_module(name)
        if module_name is None or module_name not in own:
            continue
        want = own[module_name]
        if tuple(tensor.shape) != tuple(want.shape):
            problems.append(f"{name} has shape {list(tensor.shape)}, expected {list(want.shape)}")
        elif want.dtype in (torch.long, torch.bool) and tensor.dtype.is_floating_point:
            problems.append(f"{name} is {tensor.dtype}, expected integers")
        else:
            loaded[module_name] = tensor
    if problems:
        raise EagleLoadError(f"{path} is not a loadable {head.layout} head: {'; '.join(problems)}")
    with torch.no_grad():
        for name, tensor in loaded.items():
            own[name].copy_(tensor)
