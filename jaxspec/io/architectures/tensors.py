"""A family's checkpoint tensor names, as data on its `Architecture` record.

The HF-name map (`jaxspec.io.tensor_map`) builds every tensor name from the config's features
(MLA, fused experts, q/k norms, sliding layers, ...) and from the family's `TensorLayout`: the
names and renames that differ between families publishing the same mechanism. The defaults are
the names transformers writes for Llama / Qwen (and DeepSeek-V3's MTP layers), so a family with
standard names states no `TensorLayout` at all.
"""

from __future__ import annotations

import dataclasses

# (hf suffix, jaxspec path inside the layer, kind); kinds as in jaxspec.io.layouts.
Entry = tuple[str, tuple[str, ...], str]


def norm_entries(*names: str) -> tuple[Entry, ...]:
  """The entries of RMSNorms stored as `{name}.weight`, held as `{name}.scale`."""
  return tuple((f"{n}.weight", (n, "scale"), "same") for n in names)


@dataclasses.dataclass(frozen=True)
class TensorLayout:
  """How one family names its checkpoint tensors where families differ.

  Attributes:
    sink: the attention sinks' tensor under `self_attn.` (MiMo: `attention_sink_bias`).
    linear_attention: a Gated DeltaNet layer's input projections under `linear_attn.`
      (Qwen3.5's four; Qwen3-Next fuses them into `in_proj_qkvz`, `in_proj_ba`).
    moe_block: the module that holds a MoE layer's router and experts (MiniMax:
      `block_sparse_moe`).
    router_bias: the sigmoid router's correction bias, under `moe_block`.
    experts: each expert's gate, up and down projection names (MiniMax: `w1`, `w3`, `w2`).
    layer_extras: tensors every decoder layer holds beyond the standard ones (Gemma 4's
      sandwich norms and layer scalar).
    moe_beside_mlp: a MoE layer's tensors when its MoE block sits beside a dense MLP that
      every layer keeps (Gemma 4); empty: MoE layers replace the MLP.
    mtp_prefix: where MTP layer k's tensors live, formatted with `k` and `layer` (the main
      layer count + k): after the main layers (DeepSeek-V3, GLM), in one `mtp.` module
      (Qwen3.5, Qwen3-Next) or under `model.mtp.layers.{k}.` (MiMo).
    mtp_names: the MTP layer's own tensors: embedding norm, hidden norm, their projection and
      output norm (DeepSeek's enorm / hnorm / eh_proj / shared_head.norm).
    mtp_block: the prefix of the MTP layer's decoder block inside it (Qwen3.5: `layers.0.`).
    mtp_renames: (decoder-layer name, the MTP block's name for it) pairs (MiMo names the MLP's
      norm `pre_mlp_layernorm`).
    unbuilt_mtp: the prefix of MTP tensors that transformers does not build and that a config
      without MTP layers skips with a warning ("": such tensors are an error).
    mtp_embed, mtp_head: the token embedding and LM head each MTP layer holds as published
      (DeepSeek-V3 / GLM: `embed_tokens.weight`, `shared_head.head.weight`; "": none). A copy
      equal to the main model's tensor is shared with it; one that differs is the layer's own
      (`ModelConfig.mtp_own_embed` / `mtp_own_head`).
  """

  sink: str = "sinks"
  linear_attention: tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
  moe_block: str = "mlp"
  router_bias: str = "gate.e_score_correction_bias"
  experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  layer_extras: tuple[Entry, ...] = ()
  moe_beside_mlp: tuple[Entry, ...] = ()
  mtp_prefix: str = "model.layers.{layer}."
  mtp_names: tuple[str, str, str, str] = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
  mtp_block: str = ""
  mtp_renames: tuple[tuple[str, str], ...] = ()
  unbuilt_mtp: str = ""
  mtp_embed: str = "embed_tokens.weight"
  mtp_head: str = "shared_head.head.weight"
