"""DeepSeek-V3 / Kimi-K2 (Multi-head Latent Attention) and the DSA targets built on it,
DeepSeek-V3.2 and GLM-5 (`glm_moe_dsa`): MLA with the lightning indexer.

MLA's shapes come from q_lora_rank (null: a plain q_proj), kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim and v_head_dim; `head_dim` is theirs (transformers writes
`head_dim = qk_rope_head_dim` into saved configs, the RoPE width, which jaxspec derives and does
not read). The MoE fields are GLM-4 MoE's (grouped sigmoid routing, shared experts,
`first_k_dense_replace`). RoPE: DeepSeek-V3 rotates interleaved feature pairs unless
`rope_interleave` is false; the DSA targets always do in attention, and in the indexer GLM-5
does while DeepSeek-V3.2 rotates half-split.
"""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.glm4_moe import read_deepseek_moe, write_deepseek_moe
from jaxspec.io.architectures.reader import HFConfigReader


def _read_mla(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  nope, rope = r.integer("qk_nope_head_dim"), r.integer("qk_rope_head_dim")
  return dict(
    read_deepseek_moe(r, kw),
    qk_norm=False,
    num_kv_heads=kw["num_heads"],  # transformers sets it so: every head reads the latent
    head_dim=nope + rope,
    q_lora_rank=r.integer("q_lora_rank", 0) or 0,  # null: a plain q_proj
    kv_lora_rank=r.integer("kv_lora_rank"),
    qk_nope_head_dim=nope,
    qk_rope_head_dim=rope,
    v_head_dim=r.integer("v_head_dim"),
  )


def _read_v3(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  return dict(_read_mla(r, kw), rope_interleave=r.flag("rope_interleave", True))


def _glm5_indexer_types(r: HFConfigReader, n: int) -> tuple[str, ...]:
  """transformers' GlmMoeDsaConfig rule: `indexer_types`, else `index_topk_pattern` ("FSS…"),
  else "full" at layers i with max(i − offset + 1, 0) % freq == 0."""
  if r.has("indexer_types"):
    return tuple(r.strings("indexer_types"))
  pattern = r.hf.get("index_topk_pattern")
  if isinstance(pattern, str):
    letters = {"F": "full", "S": "shared"}
    if any(c not in letters for c in pattern):
      raise r.error(f"index_topk_pattern must be letters F and S, got {pattern!r}")
    return tuple(letters[c] for c in pattern)
  if pattern is not None:
    return tuple(r.strings("index_topk_pattern"))
  freq = max(r.integer("index_topk_freq", 1), 1)
  offset = r.integer("index_skip_topk_offset", 2)
  return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))


def _read_dsa(r: HFConfigReader, kw: dict[str, Any], glm: bool) -> dict[str, Any]:
  n = kw["num_layers"]
  fields = _read_mla(r, kw)
  if r.has("mlp_layer_types"):  # transformers' per-layer form of first_k_dense_replace
    kinds = r.strings("mlp_layer_types")
    if len(kinds) != n or any(k not in ("dense", "sparse") for k in kinds):
      raise r.error(f"mlp_layer_types must be 'dense' or 'sparse' for each of the {n} layers")
    fields["layer_is_moe"] = tuple(k == "sparse" for k in kinds)
  return dict(
    fields,
    rope_interleave=True,
    index_n_heads=r.integer("index_n_heads"),
    index_head_dim=r.integer("index_head_dim"),
    index_topk=r.integer("index_topk"),
    indexer_types=_glm5_indexer_types(r, n) if glm else ("full",) * n,
    indexer_rope_interleave=glm,
  )


def _write_mla(c: ModelConfig) -> dict[str, Any]:
  return dict(
    write_deepseek_moe(c),
    head_dim=c.qk_rope_head_dim,  # as transformers saves it (the RoPE width)
    q_lora_rank=c.q_lora_rank or None,
    kv_lora_rank=c.kv_lora_rank,
    qk_nope_head_dim=c.qk_nope_head_dim,
    qk_rope_head_dim=c.qk_rope_head_dim,
    v_head_dim=c.v_head_dim,
  )


def _write_v3(c: ModelConfig) -> dict[str, Any]:
  return dict(_write_mla(c), rope_interleave=c.rope_interleave)


def _write_dsa(c: ModelConfig, glm: bool) -> dict[str, Any]:
  hf = dict(
    _write_mla(c),
    index_n_heads=c.index_n_heads,
    index_head_dim=c.index_head_dim,
    index_topk=c.index_topk,
  )
  if glm:
    hf["indexer_types"] = list(c.indexer_types)
  return hf


_MLA = dict(dense_width=True, rotary_fraction=None, family=Family(mla=True))
_DSA = dict(
  _MLA,
  attention_layer_types=("full_attention", "indexed_attention"),
  family=Family(mla=True, dsa=True),
)
DEEPSEEK_V3 = Architecture(
  name="DeepseekV3ForCausalLM", model_type="deepseek_v3", read=_read_v3, write=_write_v3, **_MLA
)
DEEPSEEK_V32 = Architecture(
  name="DeepseekV32ForCausalLM",
  model_type="deepseek_v32",
  read=lambda r, kw: _read_dsa(r, kw, glm=False),
  write=lambda c: _write_dsa(c, glm=False),
  **_DSA,
)
GLM_MOE_DSA = Architecture(
  name="GlmMoeDsaForCausalLM",
  model_type="glm_moe_dsa",
  read=lambda r, kw: _read_dsa(r, kw, glm=True),
  write=lambda c: _write_dsa(c, glm=True),
  **_DSA,
)
# Kimi-K2.5 wraps a DeepSeek-V3 text model (its `text_config`) with a vision tower: published
# config.json names the remote-code class, transformers' own save names `Kimi_K25...`.
MULTIMODAL_TEXT = {
  "KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM",
  "Kimi_K25ForConditionalGeneration": "DeepseekV3ForCausalLM",
}
