"""The recurrent kind: Gated DeltaNet layers' fixed-size state, with per-prefix snapshots."""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.errors import ConfigError
from jaxspec.state.base import Kind

# Logical axes of a LinearState's arrays, by field (conv channels and state dims unsharded).
LINEAR_STATE_AXES = {
  "conv": ("layers", "batch", None, None),
  "ssm": ("layers", "batch", None, None, None),
  "pending_conv": ("layers", "batch", None, None),
  "pending_ssm": ("layers", "batch", None, None, None, None),
  "pending_start": ("batch",),
}


@flax.struct.dataclass
class LinearState(Kind):
  """Decoding state of a segment of Gated DeltaNet (linear-attention) layers: a fixed number of
  bytes per sequence, whatever the context length.

  conv [L, B, K−1, C]: the conv window (the last K−1 inputs of the q/k/v channels, activation
  dtype); ssm [L, B, H, Dk, Dv] float32: the delta-rule state; both after the committed tokens.

  A forward over a block of T ≤ `RunOptions.linear_snapshots` tokens without `valid` lengths
  (decode, chain verification) leaves the state as it was and fills the *pending* fields:
  pending_conv [L, B, K−1+T, C] (the window before the block, then the block's conv inputs;
  rows a..a+K−2 are the window after a tokens) and pending_ssm [L, B, T+1, H, Dk, Dv] (the
  state after a = 0..T tokens), for the block at pending_start [B]. A tree block (ancestor mask)
  fills them per node instead (node i's conv input and the state after its root path), and
  `commit_path` reorders them along the accepted path so that they read as a chain.
  `DecodingState.with_lengths` (and `commit`) then keeps the snapshot of the committed prefix,
  a = lengths − pending_start, and drops the pending fields (`committed`): only the committed
  state is carried between steps. Any other block (prefill with `valid` lengths, or a longer
  block, taken as committed whole) writes the state after its valid tokens directly. A block at
  position 0 starts from zeros.
  """

  conv: jax.Array
  ssm: jax.Array
  pending_conv: jax.Array | None = None
  pending_ssm: jax.Array | None = None
  pending_start: jax.Array | None = None

  format: ClassVar[str] = "linear"
  max_len: ClassVar[int] = 2**31 - 1  # no length limit of its own
  AXES: ClassVar[dict] = LINEAR_STATE_AXES

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int = 0) -> "LinearState":
    del max_len  # fixed size
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    channels += config.linear_num_value_heads * config.linear_value_head_dim
    conv = (num_layers, batch, config.linear_conv_kernel_dim - 1, channels)
    ssm = (
      num_layers,
      batch,
      config.linear_num_value_heads,
      config.linear_key_head_dim,
      config.linear_value_head_dim,
    )
    return cls(jnp.zeros(conv, jnp.dtype(config.dtype)), jnp.zeros(ssm, jnp.float32))

  @property
  def has_pending(self) -> bool:
    return self.pending_ssm is not None

  def initial(self, layer: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(conv window [B, K−1, C], recurrent state [B, H, Dk, Dv]) a block at `start` resumes
    from: the committed state, or zeros at position 0 (a new sequence)."""
    fresh = start == 0
    window = jnp.where(fresh[:, None, None], 0, self.conv[layer])
    return window, jnp.where(fresh[:, None, None, None], 0.0, self.ssm[layer])

  def begin_block(self, start: jax.Array, t: int, keep: bool) -> "LinearState":
    """With `keep` (a block that may be accepted in part), room for its per-prefix states."""
    return self.with_pending(start, t) if keep else self

  def with_pending(self, start: jax.Array, t: int) -> "LinearState":
    """Room for the per-position states of a block of t tokens at `start`."""
    n, b, rows, c = self.conv.shape
    return self.replace(
      pending_conv=jnp.zeros((n, b, rows + t, c), self.conv.dtype),
      pending_ssm=jnp.zeros((n, b, t + 1, *self.ssm.shape[2:]), jnp.float32),
      pending_start=start.astype(jnp.int32),
    )

  def write_snapshots(
    self, layer: jax.Array, conv_inputs: jax.Array, s0: jax.Array, states: jax.Array
  ) -> "LinearState":
    """A short block's conv inputs [B, K−1+T, C], initial state and per-position states
    [B, T, H, Dk, Dv] into the pending fields."""
    ssm = jnp.concatenate([s0[:, None], states], axis=1)
    return self.replace(
      pending_conv=self.pending_conv.at[layer].set(conv_inputs.astype(self.conv.dtype)),
      pending_ssm=self.pending_ssm.at[layer].set(ssm),
    )

  def write_final(
    self, layer: jax.Array, n: jax.Array, conv_inputs: jax.Array, final: jax.Array
  ) -> "LinearState":
    """The state after the first n [B] tokens of a block (conv inputs [B, K−1+T, C])."""
    k = self.conv.shape[2]
    rows = jnp.arange(n.shape[0])[:, None]
    window = conv_inputs[rows, n[:, None] + jnp.arange(k)[None, :]]
    return self.replace(
      conv=self.conv.at[layer].set(window.astype(self.conv.dtype)),
      ssm=self.ssm.at[layer].set(final),
    )

  def committed(self, lengths: jax.Array) -> "LinearState":
    """The state after `lengths` tokens: the pending snapshot of the committed prefix (a =
    lengths − pending_start, clipped to the block), pending fields dropped."""
    if not self.has_pending:
      return self
    t = self.pending_ssm.shape[2] - 1
    k = self.conv.shape[2]
    a = jnp.clip(lengths - self.pending_start, 0, t)  # [B]
    rows = jnp.arange(a.shape[0])
    cols = a[:, None] + jnp.arange(k)[None, :]
    conv = self.pending_conv[:, rows[:, None], cols]  # [L, B, K−1, C]
    ssm = self.pending_ssm[:, rows, a]  # [L, B, H, Dk, Dv]
    return LinearState(conv, ssm)

  def commit_path(self, start: jax.Array, path: jax.Array) -> "LinearState":
    """Reorders a tree block's per-node snapshots so that the accepted path (node indices
    [B, n], root first) reads as a chain: snapshot a (after a tokens) ← the state after node
    path[a − 1], conv input K−2+a ← node path[a − 1]'s. `committed` then keeps a = lengths −
    pending_start as for a chain prefix: the accepted node's state and the last K−1 conv inputs
    of its root path (the old window's tail when the path is shorter). `start` is implied by
    pending_start."""
    del start
    if not self.has_pending:
      raise ConfigError("commit_path on a LinearState without a tree block's per-node states")
    k = self.conv.shape[2]
    rows = jnp.arange(path.shape[0])[:, None]
    to = jnp.arange(path.shape[1])[None, :]
    conv = self.pending_conv.at[:, rows, k + to].set(self.pending_conv[:, rows, k + path])
    ssm = self.pending_ssm.at[:, rows, 1 + to].set(self.pending_ssm[:, rows, 1 + path])
    return self.replace(pending_conv=conv, pending_ssm=ssm)
