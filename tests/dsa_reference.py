"""A plain numpy (float64) reference of DeepSeek Sparse Attention models: DeepSeek-V3.2
(`deepseek_v32`) and GLM-5 (`glm_moe_dsa`), written from DeepSeek-V3.2-Exp's published
inference code (inference/model.py: `Indexer`, `MLA`, `MoE`) and the V3.2 paper, without the
FP8 and kernel machinery. It shares no code with jaxspec or transformers; only the weights
(a transformers state dict) and the config keys come from transformers.

Per DSA layer, the lightning indexer scores key s for query t as

  I[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s]) · index_head_dim^-½,  w = weights_proj(x) · H^-½,

q = wq_b(q latent after q_a_layernorm) per head, k = LayerNorm(wk(x)) one per token, RoPE on
the FIRST qk_rope_head_dim features of both. The published code differs from this only where
it does not change the math: the Hadamard rotation of q and k (orthonormal, so q·k is
unchanged) exists to make their FP8 quantization accurate, and FP8 is not modelled here.
Each query keeps the `index_topk` highest scores among the keys it may see (causal), every
key when it sees fewer, and MLA attends to those keys only.

What differs between the two families (checked against transformers 5.24's glm_moe_dsa and
deepseek_v32, and zai-org's GLM-5 configs):
* indexer RoPE: GLM-5 rotates interleaved pairs; DeepSeek-V3.2 the half-split layout
  (DeepSeek corrected its inference code to that in 2025-11; the Exp repository's snapshot
  still rotates pairs). MLA's own RoPE is the interleaved pairs in both.
* GLM-5's `indexer_types`: a "shared" layer has no indexer and reuses the selection of the
  previous layer.

Ties: a key whose q·k is negative for every head scores exactly 0, so several keys of a query
can tie exactly, also at the top-k boundary. The published code (torch.topk) leaves that
choice to the kernel. This reference keeps the EARLIER key on an exact tie (`tie="first"`;
`"last"` is the opposite rule, for tests that show the choice matters): a rule that depends
on nothing but the scores and positions, so a query's choice does not change when later
tokens are appended.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: RMSNorm(dim) with its default eps
INDEX_NORM_EPS = 1e-6  # the indexer's key LayerNorm


def _rope(x: np.ndarray, positions: np.ndarray, theta: float, interleave: bool) -> np.ndarray:
  """x [T, ..., d] rotated by position: pairs (2i, 2i+1) when interleaved, (i, i + d/2) else;
  pair i turns by position · theta^(-2i/d)."""
  d = x.shape[-1]
  angle = positions[:, None].astype(np.float64) * theta ** (-np.arange(0, d, 2) / d)  # [T, d/2]
  angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
  cos, sin = np.cos(angle), np.sin(angle)
  a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : d // 2], x[..., d // 2 :])
  ra, rb = a * cos - b * sin, a * sin + b * cos
  if interleave:
    return np.stack([ra, rb], axis=-1).reshape(x.shape)
  return np.concatenate([ra, rb], axis=-1)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
  centred = x - x.mean(-1, keepdims=True)
  return centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + eps) * w + b


def _silu(x: np.ndarray) -> np.ndarray:
  return x / (1.0 + np.exp(-x))


def select(scores: np.ndarray, k: int, tie: str = "first") -> np.ndarray:
  """bool [T, T]: per query t, the k highest scores [T, T] among keys s ≤ t (all of them when
  t < k); on an exact tie the earlier key (`tie="first"`) or the later one ("last")."""
  n = scores.shape[0]
  keep = np.zeros((n, n), bool)
  for t in range(n):
    order = np.arange(t + 1) if tie == "first" else np.arange(t, -1, -1)
    ranked = order[np.argsort(-scores[t, order], kind="stable")]
    keep[t, ranked[:k]] = True
  return keep


def boundary_gaps(scores: np.ndarray, k: int) -> np.ndarray:
  """[T] the gap between each query's k-th and (k+1)-th visible score (inf when it sees ≤ k):
  0 where the top-k set is ambiguous (an exact tie), small where rounding could flip it."""
  gaps = np.full(scores.shape[0], np.inf)
  for t in range(k, scores.shape[0]):
    v = np.sort(scores[t, : t + 1])[::-1]
    gaps[t] = v[k - 1] - v[k]
  return gaps


@dataclasses.dataclass
class Trace:
  """What a forward chose: per DSA layer with its own indexer, the index scores [T, T]
  (causal entries only meaningful) and the selection [T, T]."""

  scores: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
  selection: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)


class Reference:
  """The reference model over a transformers state dict and config dict (float64)."""

  def __init__(self, state: dict[str, Any], config: dict[str, Any], tie: str = "first"):
    self.w = {k: np.asarray(v, np.float64) for k, v in state.items()}
    self.c = config
    self.tie = tie
    self.layers = config["num_hidden_layers"]
    self.indexer_types = config.get("indexer_types") or ["full"] * self.layers
    self.index_interleave = config["model_type"] == "glm_moe_dsa"
    mlp_types = config.get("mlp_layer_types")
    first_dense = config.get("first_k_dense_replace", 0)
    self.moe = [
      (mlp_types[i] == "sparse") if mlp_types else i >= first_dense for i in range(self.layers)
    ]
    self.theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    if (config.get("rope_parameters") or {}).get("rope_type", "default") != "default":
      raise NotImplementedError("the reference implements the default RoPE only")

  def _p(self, layer: int, name: str) -> np.ndarray:
    return self.w[f"model.layers.{layer}.{name}"]

  def index_scores(self, layer: int, x: np.ndarray, q_lat: np.ndarray) -> np.ndarray:
    """[T, T] index scores of the layer's lightning indexer (x [T, hidden] normed input)."""
    c, p = self.c, lambda n: self._p(layer, "self_attn.indexer." + n)
    heads, dim, dr = c["index_n_heads"], c["index_head_dim"], c["qk_rope_head_dim"]
    positions = np.arange(x.shape[0])
    q = (q_lat @ p("wq_b.weight").T).reshape(-1, heads, dim)
    k = _layer_norm(x @ p("wk.weight").T, p("k_norm.weight"), p("k_norm.bias"), INDEX_NORM_EPS)
    q = np.concatenate(
      [_rope(q[..., :dr], positions, self.theta, self.index_interleave), q[..., dr:]], -1
    )
    k = np.concatenate(
      [_rope(k[..., :dr], positions, self.theta, self.index_interleave), k[..., dr:]], -1
    )
    w = x @ p("weights_proj.weight").T * heads**-0.5  # [T, H]
    qk = np.maximum(np.einsum("thd,sd->ths", q, k), 0.0) * dim**-0.5
    return np.einsum("th,ths->ts", w, qk)

  def attention(self, layer: int, x: np.ndarray, trace: Trace, prev: np.ndarray | None):
    """(MLA output [T, hidden], the selection [T, T] it attended with)."""
    c, p = self.c, lambda n: self._p(layer, "self_attn." + n)
    heads, dn, dr = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
    r, dv = c["kv_lora_rank"], c["v_head_dim"]
    positions = np.arange(x.shape[0])
    q_lat = _rms_norm(x @ p("q_a_proj.weight").T, p("q_a_layernorm.weight"), LATENT_NORM_EPS)
    q = (q_lat @ p("q_b_proj.weight").T).reshape(-1, heads, dn + dr)
    q_nope, q_rope = q[..., :dn], _rope(q[..., dn:], positions, self.theta, True)
    latent = x @ p("kv_a_proj_with_mqa.weight").T
    c_kv = _rms_norm(latent[:, :r], p("kv_a_layernorm.weight"), LATENT_NORM_EPS)
    k_rope = _rope(latent[:, r:], positions, self.theta, True)  # [T, dr], one for all heads
    kv = (c_kv @ p("kv_b_proj.weight").T).reshape(-1, heads, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    if self.indexer_types[layer] == "full":
      scores = self.index_scores(layer, x, q_lat)
      keep = select(scores, c["index_topk"], self.tie)
      trace.scores[layer], trace.selection[layer] = scores, keep
    else:  # GLM-5 "shared": the previous layer's choice
      keep = prev
    logits = np.einsum("thd,shd->hts", q_nope, k_nope) + np.einsum("thd,sd->hts", q_rope, k_rope)
    logits = np.where(keep[None], logits * (dn + dr) ** -0.5, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, v).reshape(x.shape[0], heads * dv)
    return out @ p("o_proj.weight").T, keep

  def mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
    """Dense SwiGLU, or the MoE: sigmoid scores, correction bias for the choice (by groups),
    the top-k weights normalized and scaled, plus the shared experts."""
    c, p = self.c, lambda n: self._p(layer, "mlp." + n)
    swiglu = lambda h, g, u, d: (_silu(h @ g.T) * (h @ u.T)) @ d.T
    if not self.moe[layer]:
      return swiglu(x, p("gate_proj.weight"), p("up_proj.weight"), p("down_proj.weight"))
    e, k = c["n_routed_experts"], c["num_experts_per_tok"]
    groups, top_groups = c["n_group"], c["topk_group"]
    scores = 1.0 / (1.0 + np.exp(-(x @ p("gate.weight").T)))  # [T, E]
    choice = scores + p("gate.e_score_correction_bias")
    by_group = np.sort(choice.reshape(-1, groups, e // groups), -1)[..., -2:].sum(-1)
    kept_groups = np.argsort(-by_group, -1, kind="stable")[:, :top_groups]
    allowed = np.zeros((x.shape[0], groups), bool)
    np.put_along_axis(allowed, kept_groups, True, -1)
    choice = np.where(np.repeat(allowed, e // groups, -1), choice, -np.inf)
    experts = np.argsort(-choice, -1, kind="stable")[:, :k]  # [T, k]
    weights = np.take_along_axis(scores, experts, -1)
    if c["norm_topk_prob"]:
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * c["routed_scaling_factor"]
    gate_up, down = p("experts.gate_up_proj"), p("experts.down_proj")  # [E, 2I, H], [E, H, I]
    half = gate_up.shape[1] // 2
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
      for j, ex in enumerate(experts[t]):
        h = _silu(gate_up[ex, :half] @ x[t]) * (gate_up[ex, half:] @ x[t])
        out[t] += weights[t, j] * (down[ex] @ h)
    shared = "shared_experts."
    return out + swiglu(
      x,
      p(shared + "gate_proj.weight"),
      p(shared + "up_proj.weight"),
      p(shared + "down_proj.weight"),
    )

  def forward(self, ids: np.ndarray) -> tuple[np.ndarray, Trace]:
    """(logits [T, vocab], trace) of one sequence ids [T]."""
    eps = self.c["rms_norm_eps"]
    x = self.w["model.embed_tokens.weight"][np.asarray(ids)]
    trace, keep = Trace(), None
    for layer in range(self.layers):
      h = _rms_norm(x, self._p(layer, "input_layernorm.weight"), eps)
      out, keep = self.attention(layer, h, trace, keep)
      x = x + out
      x = x + self.mlp(layer, _rms_norm(x, self._p(layer, "post_attention_layernorm.weight"), eps))
    x = _rms_norm(x, self.w["model.norm.weight"], eps)
    return x @ self.w["lm_head.weight"].T, trace
