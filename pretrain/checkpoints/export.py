"""Export a checkpoint as a Hugging Face model directory that ``transformers`` loads as
``GPT2LMHeadModel`` (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(OUT)``).

``trainer.model.GPT`` is GPT-2's architecture under GPT-2's parameter names, so the mapping is
exact (the logits agree to the last bits), with no change to the model:

- the four linear layers of each block become GPT-2's ``Conv1D``, which stores its weight as
  (in, out): those weights are transposed; biases everywhere but the LM head, as in GPT-2;
- the LM head is tied to the token embedding (``tie_word_embeddings``): only ``wte`` is stored;
- LayerNorm eps 1e-5 is torch's default and GPT-2's ``layer_norm_epsilon``;
- GELU with the tanh approximation: ``gelu_pytorch_tanh`` runs the same torch kernel
  (``gelu_new``, GPT-2's default, writes the formula out and differs in the last bits);
- attention is causal, scaled by 1/sqrt(head size), not by layer index;
- dropout (0 by default) sits after the embeddings, in attention and after the MLP; GPT-2 also
  drops after the attention projection. All three GPT-2 probabilities get our ``dropout``, so
  fine-tuning with dropout > 0 differs slightly; inference is identical.

The directory is written next to ``out`` under a temporary name, then renamed into place, so
``out`` is either absent or complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from pretrain.checkpoints.evaluation import require_valid
from pretrain.checkpoints.export_target import PROVENANCE, check_out
from pretrain.checkpoints.info import CheckpointInfo, CheckpointInfoError, describe
from pretrain.data.prepare.tokenizer import EOT
from trainer.checkpoint.sharded import load_full_state
from trainer.checkpoint.store import model_files
from trainer.common.atomic import fsync_dir
from trainer.job.config import ModelConfig

WEIGHTS = "model.safetensors"
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def hf_config(cfg: ModelConfig, eot_id: int) -> dict:
    """``config.json`` of the equivalent ``GPT2LMHeadModel``."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_pytorch_tanh",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
    }


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our GPT's state dict under ``GPT2LMHeadModel``'s names and layouts (tied head dropped)."""
    if not torch.equal(state["lm_head.weight"], state["wte.weight"]):
        raise ValueError("lm_head.weight differs from wte.weight: the checkpoint's embeddings are not tied")
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            continue
        t = t.detach().to("cpu")
        out[f"transformer.{name}"] = (t.t() if name.endswith(_CONV1D) else t).contiguous().clone()
    return out


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json(path: Path, obj: dict) -> None:
    _write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _tokenizer_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:  # gone, a directory where the file belongs, no permission
        raise CheckpointInfoError(
            f"cannot read the data set's tokenizer {path} ({err.strerror or err}): give the data "
            "set the checkpoint was trained on with --data-dir, or prepare it again"
        ) from None


def write_hf_dir(tmp: Path, info: CheckpointInfo) -> None:
    """Fill ``tmp`` with the weights, configs, tokenizer and a provenance record."""
    from safetensors.torch import save_file

    data = info.data_manifest()
    eot_id, cfg = data["eot_id"], info.model
    state = load_full_state(info.store(), info.step)["model"]  # whole, or reassembled from FSDP shards
    save_file(hf_state_dict(state), str(tmp / WEIGHTS), metadata={"format": "pt"})
    with open(tmp / WEIGHTS, "rb") as f:
        os.fsync(f.fileno())
    _json(tmp / "config.json", hf_config(cfg, eot_id))
    _json(tmp / "generation_config.json", {"bos_token_id": eot_id, "eos_token_id": eot_id})
    _write(tmp / "tokenizer.json", _tokenizer_bytes(info.data_dir / data.get("tokenizer", "tokenizer.json")))
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    _json(tmp / "special_tokens_map.json", special)
    _json(
        tmp / "tokenizer_config.json",
        {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.max_seq_len,
            "clean_up_tokenization_spaces": False,
        },
    )
    _json(
        tmp / PROVENANCE,
        {
            "checkpoint": info.location,
            "step": info.step,
            "stage": info.manifest.meta.get("stage"),
            "model_sha256": {
                n: info.manifest.files[n].sha256
                for n in model_files(list(info.manifest.files), info.manifest.world_size)
            },
            "model": asdict(cfg),
            "data_dir": str(info.data_dir),
            "data_fingerprint": data.get("fingerprint"),
            "exported": time.time(),
        },
    )
    fsync_dir(tmp)


def export_model(info: CheckpointInfo, out: str | Path, *, overwrite: bool = False) -> Path:
    """Validate the checkpoint (refusing a bad one: :class:`CheckpointRejected`), then write
    its Hugging Face directory to ``out`` atomically. ``overwrite`` replaces an existing ``out``
    that is an earlier export (:func:`check_out` refuses anything else: :class:`ExportRefused`)."""
    out = Path(out).expanduser().absolute()
    check_out(out, str(info.location), overwrite)
    require_valid(info)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        write_hf_dir(tmp, info)
        if out.exists():  # overwrite: move the old one aside, the new one in, then delete the old
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_checkpoint(
    location: str | Path,
    out: str | Path,
    *,
    options: dict | None = None,
    data_dir: str | Path | None = None,
    model: ModelConfig | None = None,
    overwrite: bool = False,
) -> Path:
    """Library entry point: export the checkpoint at ``location`` (local or ``s3://``) to ``out``.
    What the manifest does not record must be given (``data_dir``, ``model``)."""
    return export_model(describe(location, options=options, data_dir=data_dir, model=model), out, overwrite=overwrite)
