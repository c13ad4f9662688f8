"""Hugging Face causal LMs for ``zeropp train --hf-model / --hf-config / --tokenizer`` and ``zeropp export``.

Everything is read from local paths (no network access at run time): a model folder holding
``config.json`` (and optionally safetensors weights, which :mod:`zeropp.checkpoint.pretrained` reads straight
into the shards), a ``config.json`` file alone (random initialization), a tokenizer folder. A hub
name such as ``gpt2`` that is not a local path is refused in one line, as is a config whose
``model_type`` is not a causal LM that ``AutoModelForCausalLM`` knows. Models are built on the meta
device (:mod:`zeropp.zero.materialize` initializes them unit by unit) and trained through their own
``forward``: the loss is the cross-entropy of ``logits`` against the next tokens, in fp32, as the
embedded GPT computes it. ``transformers`` is an optional extra (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.errors import ConfigError
from zeropp.runtime.tiled_logits import tiled_cross_entropy

INSTALL = "pip install -e '.[hf]' (or pip install transformers)"


class HFError(ConfigError):
    """A Hugging Face model, config or tokenizer that cannot be used. One line."""


def transformers(why: str = "Hugging Face models (--hf-model, --hf-config)") -> Any:
    """The transformers module, or a one-line HFError saying how to install it."""
    try:
        import transformers as module
    except ImportError:
        raise HFError(f"{why} need the optional package transformers, which is not installed: {INSTALL}") from None
    return module


def local_path(flag: str, value: str, want: str) -> Path:
    """`value` as an existing local path of kind `want` ('folder' or 'file'); a hub name or a missing
    path is refused in one line naming `flag`."""
    path = Path(value).expanduser()
    if not path.exists():
        hub_like = not value.startswith((".", "/", "~")) and value.count("/") <= 1 and not Path(value).suffix
        if hub_like:
            raise HFError(
                f"{flag} {value!r} is not a local path (a hub name?); zeropp reads models and tokenizers from "
                f"local {want}s only, with no downloads: fetch it first (e.g. `hf download {value} --local-dir DIR`) "
                "and pass DIR"
            )
        raise HFError(f"{flag} {value!r} does not exist; expected a local {want}")
    if (want == "folder") != path.is_dir():
        raise HFError(f"{flag} {value!r} is not a {want}")
    return path


def config_file(hf_model: str | None, hf_config: str | None) -> tuple[str, Path]:
    """(flag, config.json path) of --hf-model DIR or --hf-config FILE."""
    if hf_model is not None:
        folder = local_path("--hf-model", hf_model, "folder")
        if not (folder / "config.json").is_file():
            raise HFError(f"--hf-model {hf_model!r} holds no config.json; expected a Hugging Face model folder")
        return "--hf-model", folder / "config.json"
    if hf_config is None:
        raise HFError("no Hugging Face model given; expected --hf-model DIR or --hf-config FILE")
    return "--hf-config", local_path("--hf-config", hf_config, "file")


def causal_lm_config(hf_model: str | None = None, hf_config: str | None = None) -> Any:
    """The model's PretrainedConfig from --hf-model DIR or --hf-config FILE, refused in one line unless
    it describes a causal LM that AutoModelForCausalLM knows."""
    flag, path = config_file(hf_model, hf_config)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HFError(f"{flag}: {str(path)!r} is not a readable JSON config ({error})") from None
    return config_from_dict(data, f"{flag} {str(path)!r}")


def config_from_dict(data: dict[str, Any], where: str) -> Any:
    """A PretrainedConfig from its dict (config.json's contents), refusing what is not a causal LM."""
    hf = transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in CONFIG_MAPPING_NAMES:
        raise HFError(f"{where} has model_type {model_type!r}, which transformers does not know")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFError(
            f"{where} has model_type {model_type!r}, which is not a causal language model "
            "(AutoModelForCausalLM knows e.g. gpt2, llama, mistral, qwen2); zeropp train trains causal LMs"
        )
    settings = {k: v for k, v in data.items() if k != "model_type"}
    return hf.AutoConfig.for_model(model_type, **settings)


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's position embeddings allow (None: not stated)."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def build_model(config: Any) -> nn.Module:
    """The causal LM of `config` in fp32, on the current default device (the meta device for zeropp train)."""
    return transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def causal_lm_loss(
    engine: Any, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None, tiled: bool = False
) -> torch.Tensor:
    """Mean next-token cross-entropy (in fp32) of the model's logits for inputs `x` against targets `y`
    (`positions`: the tokens' places, None for 0, 1, ...); `tiled`: by the forward :func:`tile_logits`
    gave the model."""
    position_ids = None if positions is None else positions.unsqueeze(0)
    if tiled:
        return engine(input_ids=x, position_ids=position_ids, targets=y)
    logits = engine(input_ids=x, position_ids=position_ids).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


# model types whose logits are their output embedding applied to the last hidden state, nothing after
# (no bias, scale or soft cap): what tiled_cross_entropy computes
PLAIN_LOGITS = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def check_tileable(model_type: str, tiles: int) -> None:
    if model_type not in PLAIN_LOGITS:
        raise HFError(
            f"model.logit_tiles = {tiles} is not allowed with model_type {model_type!r}, whose logits zeropp cannot "
            f"tile as it computes them; expected 1, or a model of type {', '.join(PLAIN_LOGITS)}"
        )


def tile_logits(model: nn.Module, tiles: int) -> nn.Module:
    """`model` whose forward, given ``targets`` (the next tokens), returns their mean cross-entropy
    computed in `tiles` tiles (See [Note: tiled logits]) instead of logits; model types outside
    PLAIN_LOGITS are refused in one line."""
    check_tileable(model.config.model_type, tiles)
    base, head = getattr(model, model.base_model_prefix), model.get_output_embeddings()

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None):
        hidden = base(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        return tiled_cross_entropy(hidden, head.weight, targets, tiles)

    model.forward = forward
    return model


def has_weights(folder: Path) -> bool:
    """Whether a model folder holds safetensors weights (pytorch_model.bin alone is refused)."""
    from zeropp.checkpoint.pretrained import INDEX, SINGLE

    if (folder / SINGLE).is_file() or (folder / INDEX).is_file():
        return True
    if any(folder.glob("pytorch_model*.bin")):
        raise HFError(
            f"--hf-model {str(folder)!r} holds only pytorch_model*.bin weights; zeropp reads safetensors "
            "(convert with transformers: from_pretrained(DIR).save_pretrained(DIR))"
        )
    return False


def load_tokenizer(path: str) -> Any:
    """A local Hugging Face tokenizer folder through AutoTokenizer (no downloads)."""
    folder = local_path("--tokenizer", path, "folder")
    hf = transformers("Hugging Face tokenizers (--tokenizer)")
    try:
        return hf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise HFError(f"--tokenizer {path!r} cannot be loaded by AutoTokenizer ({reason})") from None


def save_pretrained(state: dict[str, torch.Tensor], config: Any, out: Path, tokenizer: str | None = None) -> None:
    """Write `state` (a full fp32 ``state_dict()``) as a Hugging Face folder: config.json and
    safetensors through ``save_pretrained``, and the tokenizer folder's files when one was used."""
    transformers().utils.logging.disable_progress_bar()  # one line of output, not a bar per file
    model = build_model(config)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(str(out))
    if tokenizer is not None:
        load_tokenizer(tokenizer).save_pretrained(str(out))


def export_folder(checkpoint: Path, out: Path) -> dict[str, Any]:
    """``zeropp export CKPT DIR``: a checkpoint of a Hugging Face model as a folder that
    ``from_pretrained`` loads (and the tokenizer's files where the run used one). Returns zeropp.json."""
    from zeropp.checkpoint.dcp import consolidated_state, read_meta

    extra = read_meta(checkpoint)["extra"]
    config = config_from_dict(extra["hf_config"], f"checkpoint {str(checkpoint)!r}")
    tokenizer = extra.get("tokenizer")
    if tokenizer is not None:
        local_path("the run's --tokenizer", tokenizer, "folder")  # still there, before anything is written
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise HFError(f"cannot write {str(out)!r}: it exists and is not an empty folder")
    meta, state = consolidated_state(checkpoint)
    save_pretrained(state, config, out, tokenizer)
    return meta


def export_adapter_folder(checkpoint: Path, out: Path) -> dict[str, Any]:
    """``zeropp export CKPT DIR --adapter-only``: a peft model's trained adapter as the folder that
    ``peft.PeftModel.from_pretrained(base, DIR)`` loads (``adapter_config.json`` and
    ``adapter_model.safetensors``, peft's names). Returns zeropp.json."""
    from safetensors.torch import save_file

    from zeropp.checkpoint.adapters import peft_key
    from zeropp.checkpoint.dcp import consolidated_state, read_meta

    adapter = read_meta(checkpoint).get("adapter")
    if adapter is None:
        raise HFError(f"checkpoint {str(checkpoint)!r} is not of a peft model: it holds no adapter to export")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise HFError(f"cannot write {str(out)!r}: it exists and is not an empty folder")
    meta, trained = consolidated_state(checkpoint, trained_only=True)
    config = dict(adapter["config"])
    if meta.get("frozen_base"):
        config["base_model_name_or_path"] = meta["frozen_base"]["path"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    tensors = {peft_key(name, adapter["name"]): t.contiguous() for name, t in trained.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return meta
