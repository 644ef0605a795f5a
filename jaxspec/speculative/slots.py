"""The slot API of `SpecEngine`: rows that come and go between runs (continuous batching).

Every batch row is an independent sequence with its own PRNG key, stop ids and sampling
parameters, so a server (jaxspec/serve/) keeps one batch_size-row state and, between calls of
`SpecEngine.run`, prefills requests as small states of their own (`prefill_row`, `prefill_rows`
for n choices of one prompt, `prefill_cached` for a prompt whose first pages are cached), puts
them into free rows (`insert`, `insert_rows`), frees rows (`evict`), maps paged K/V
(`set_page_table`) and reads back what a run produced (`recent`). None of them recompiles
after warm-up (`SpecEngine.warm_up_slots`); a request's output does not depend on the row it
runs in or on its neighbours (up to float rounding of batched kernels).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sharding
from jaxspec.errors import ConfigError, InputError
from jaxspec.speculative import prefix as prefix_lib
from jaxspec.speculative import step as step_lib
from jaxspec.speculative.request import Request, SamplingArgs, takes_sampling_args
from jaxspec.speculative.step import SpecState


class SlotMethods:
  """`SpecEngine`'s slot methods (a mixin: they run on the engine's config, verifier, jitted
  functions and request checks, which `SpecEngine.__init__` assembles)."""

  def window(self, steps: int) -> int:
    """The most tokens a row can have that `recent` has not shown after a chunk of `steps`
    steps: its first token (sampled at prefill) and up to `max_commit` tokens a step."""
    return 1 + steps * self.verifier.max_commit

  def recent(self, state: SpecState, window: int) -> dict[str, jax.Array]:
    """Each row's last `window` tokens and log-probs, lengths, done and stop flags and
    counters (`step.recent`): what a server reads back after a loop chunk, O(B·window), not
    the O(B·max_len) buffers. One compilation per window."""
    return self._recent(state, window)

  def empty_state(self) -> SpecState:
    """A batch_size-row state with every row free (done): the start of a slot-served engine."""
    request = self._request([[0]] * self.config.batch_size, SamplingArgs(max_new_tokens=1))
    state = self._start(request, free=True)
    return self.evict(state, jnp.arange(self.config.batch_size))

  @takes_sampling_args
  def prefill_row(self, prompt: Any, *args: Any, **kwargs: Any) -> SpecState:
    """One request (a str or 1-D token ids) prefilled as a one-row state, for `insert`.

    Sampling arguments as for `generate` (one value each). Validated as `generate` validates;
    its key is fold_in(PRNGKey(seed), 0), as for a single-prompt `generate`, so the request
    samples what it samples alone.
    """
    request = self._request([prompt], SamplingArgs.of(args, kwargs, "prefill_row"), 1)
    return self._start(request, batch=1)

  def prefill_rows(self, prompt: Any, arguments: Sequence[SamplingArgs]) -> SpecState:
    """One request sampled n = len(arguments) times (OpenAI's `n`): the prompt prefilled once
    for a state of `choice_group(n)` rows (`insert_rows` takes the first n), row i with
    `arguments[i]` (one value each; its own seed).

    The target runs the prompt once; each row draws its first token from those logits with
    its own key and sampling arguments, and its drafter absorbs the same features, so row i
    samples exactly what `prefill_row(prompt, arguments[i])` samples. One compilation per
    group size (and prompt bucket)."""
    request, n = self._group_request(prompt, arguments)
    return self._start(request, batch=n, copies=n if n > 1 else 1)

  def prefill_cached(
    self,
    state: SpecState,
    prompt: Any,
    arguments: SamplingArgs | Sequence[SamplingArgs],
    pages: Sequence[int] = (),
  ) -> SpecState:
    """`prefill_row` (one SamplingArgs) or `prefill_rows` (a list) of a prompt whose first
    len(pages) pages of positions are cached in `state`'s pool, at those pool pages
    (EngineConfig.prefix_cache; the server's page allocator knows which): the target reads
    their K/V and the drafter their kept features, and only the rest is prefilled. The rows
    sample what a full prefill samples. At least the prompt's last position must be left to
    prefill. One compilation per prompt bucket (and n) whatever `pages` holds; `state` is
    read, not donated."""
    cfg = self.config
    if not cfg.prefix_cache:
      raise ConfigError("prefill_cached: this engine has no prefix cache (EngineConfig)")
    group = not isinstance(arguments, SamplingArgs)
    request, n = self._group_request(prompt, arguments if group else [arguments])
    pages = [int(p) for p in pages]
    if not all(0 <= p < cfg.num_pages for p in pages):
      raise InputError(f"prefill_cached: page ids must be in [0, {cfg.num_pages}), got {pages}")
    table = np.full((cfg.pages_per_row,), cfg.num_pages, np.int32)
    table[: len(pages)] = pages
    prefix = prefix_lib.CachedPrefix(
      state.target_state,
      state.prefix_features,
      *self._to_device((table, np.int32(len(pages))), ((None,), ())),
    )
    return self._start(request, batch=n, copies=n if n > 1 else 1, prefix=prefix)

  def _group_request(
    self, prompt: Any, arguments: Sequence[SamplingArgs]
  ) -> tuple[Request, int]:
    """The Request of one prompt sampled once per SamplingArgs (one value each), padded with
    copies of the last to `choice_group` rows (dropped at `insert_rows`), and its rows."""
    arguments = list(arguments)
    if not arguments or not all(isinstance(a, SamplingArgs) for a in arguments):
      raise InputError("prefill_rows: give one SamplingArgs per row (at least one)")
    if len({bool(a.parse_special) for a in arguments}) > 1:
      raise InputError("prefill_rows: parse_special must be the same for every row")
    if len(arguments) == 1:
      return self._request([prompt], arguments[0], 1), 1
    arguments += arguments[-1:] * (self.choice_group(len(arguments)) - len(arguments))
    per_row = {
      f.name: [getattr(a, f.name) for a in arguments]
      for f in dataclasses.fields(SamplingArgs)
      if f.name != "parse_special"
    }
    per_row["stop_token_ids"] = [list(s or ()) for s in per_row["stop_token_ids"]]
    per_row["logit_bias"] = [b or {} for b in per_row["logit_bias"]]
    merged = SamplingArgs(parse_special=arguments[0].parse_special, **per_row)
    n = len(arguments)
    return self._request([prompt] * n, merged, n), n

  def choice_group(self, n: int) -> int:
    """The rows a group prefill of n choices runs: n rounded up to a power of two, at most
    batch_size (one compilation per group size and prompt bucket, not per n)."""
    return min(1 << max(n - 1, 0).bit_length(), max(self.config.batch_size, n))

  def insert_rows(self, state: SpecState, slots: Sequence[int], rows: SpecState) -> SpecState:
    """`insert` of row i of a group state (`prefill_rows`) at `slots[i]`, for the first
    len(slots) rows (the group's padding rows are dropped); paged K/V: the rows' shared prompt
    pages are copied to each slot's pages (the scheduler maps the full ones to the same pool
    pages, serve/pages.py). Donates `state`."""
    slots = [int(s) for s in slots]
    if self._take_row is None:
      axes = self._shapes.batch_axes()

      def take(rows_state, i):
        pick = lambda ax, x: x if ax is None else jax.lax.dynamic_slice_in_dim(x, i, 1, axis=ax)
        return jax.tree_util.tree_map(pick, axes, rows_state, is_leaf=lambda x: x is None)

      self._take_row = self._on_mesh(jax.jit(take))
    if not 1 <= len(slots) <= int(rows.seq_len.shape[0]):
      raise InputError(f"insert_rows: {len(slots)} slots for {rows.seq_len.shape[0]} rows")
    for i, slot in enumerate(slots):
      state = self.insert(state, slot, self._take_row(rows, jnp.int32(i)))
    return state

  @takes_sampling_args
  def check_row(self, prompt: Any, *args: Any, **kwargs: Any) -> None:
    """Raises the InputError that `prefill_row` would raise for these arguments, on the host
    only (no device work): what a server checks before it queues a request."""
    self._checked(self._request([prompt], SamplingArgs.of(args, kwargs, "check_row"), 1), 1)

  def insert(self, state: SpecState, slot: Any, row: SpecState) -> SpecState:
    """`state` with batch row `slot` replaced by the one-row state `row` (from `prefill_row`):
    tokens, the target's and the drafter's decoding state, key, stop ids, sampling, stats.
    One compilation for every slot; donates `state`."""
    if not 0 <= int(slot) < self.config.batch_size:
      raise InputError(f"slot {slot} is outside the batch [0, {self.config.batch_size})")
    if self._insert is None:
      self._insert = self._on_mesh(
        jax.jit(
          functools.partial(
            step_lib.insert_row, self._shapes.batch_axes(), state_axes=self._state_axes
          ),
          donate_argnums=(0,),
        )
      )
    return self._insert(state, jnp.int32(slot), row)

  def set_page_table(self, state: SpecState, table: Any) -> SpecState:
    """`state` with the page tables [batch_size, max_len / page_size] (int; pool page ids,
    `num_pages` = none): which pool pages hold each row's positions (EngineConfig.page_size;
    the server's page allocator, serve/pages.py, owns them). One compilation; donates `state`."""
    cfg = self.config
    table = np.asarray(table)
    if not cfg.page_size:
      raise ConfigError("set_page_table: this engine has no paged KV (EngineConfig.page_size)")
    if table.shape != (cfg.batch_size, cfg.pages_per_row) or table.dtype.kind not in "iu":
      raise InputError(
        f"set_page_table: expected integer page ids of shape {(cfg.batch_size, cfg.pages_per_row)}"
        f", got {table.dtype} {table.shape}"
      )
    if table.size and not 0 <= int(table.min()) <= int(table.max()) <= cfg.num_pages:
      raise InputError(f"set_page_table: page ids must be in [0, {cfg.num_pages}]")
    table = self._to_device(table.astype(np.int32), (sharding.BATCH, None))
    return self._set_pages(state, table)

  def evict(self, state: SpecState, slot: Any) -> SpecState:
    """`state` with row(s) `slot` (an index or a sequence of them) marked done: they commit
    nothing more and their slots may be reused by `insert`. One compilation; donates `state`."""
    rows = np.zeros((self.config.batch_size,), bool)
    rows[np.asarray(slot, np.int64)] = True
    return self._evict(state, self._to_device(rows, (sharding.BATCH,)))

