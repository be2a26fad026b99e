"""What one program of the Mosaic forward (forward.py) works on: its static
parameters (ForwardParams), its shared memory (forward_scratch) and its work
items (work): one item per program, or, persistent, items taken in turn."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from ua_reference.contract import StaticSpec

from . import common
from .common import launched_q_tile, program_spans, program_tiles
from ..tile_math import kv_tiles

# Columns of the ones tile whose product with P sums P as the tensor cores used
# it (sums_rounded): wgmma's narrowest N.
USED_SUM_COLUMNS = 8


@dataclasses.dataclass(frozen=True)
class ForwardParams:
  """The static parameters of one forward kernel: the contract's rules
  (``spec``; ``spec_padded`` is it over the padded length, which tile ranges
  count over), the tiles, the inputs' dtype and options, and the work's
  layout: ``programs`` persistent programs (0: one program per work item, a
  grid of heads x q_tiles x batch)."""
  spec: StaticSpec
  spec_padded: StaticSpec
  dtype: Any
  block_q: int          # rows of one compute warpgroup; a program owns 2 * block_q
  block_kv: int
  head_dim: int         # padded (common.padded_head_dim)
  stages: int
  padded: bool          # the sequence is padded (visible_mask hides the padding)
  has_temp: bool
  shift: float | None   # tile_math.fixed_shift
  fast_cap: bool
  rounded_sum: bool     # softmax_state.sums_rounded: out normalised by P @ ones
  q_tiles: int = 1      # work items per (batch, head): padded length / rows
  programs: int = 0     # persistent programs (0: not persistent)
  separate_out: bool = False  # O leaves through its own buffer, not Q's
  overlap_softmax: bool = False  # MosaicTiles.overlap_softmax (_overlapped_tiles)
  has_sinks: bool = False  # a sink logit per head joins each row's mass at the end

  @property
  def rows(self) -> int:
    return 2 * self.block_q

  @property
  def items(self) -> int:
    return self.spec.batch * self.spec.num_q_heads * self.q_tiles


def forward_scratch(p: ForwardParams) -> list:
  """The forward kernel's shared memory: Q tiles (which hold O on its way out
  unless ``separate_out``), the K and V rings, the lse rows, then the
  barriers: Q loaded, K and V loaded per slot, K and V free per slot, the
  schedule barrier; with ``rounded_sum`` a ones tile per compute warpgroup
  and its loaded barrier; with ``separate_out`` O's tiles."""
  plgpu = common.plgpu()
  swizzled = common.swizzled()
  rounded = [
      plgpu.SMEM((2, USED_SUM_COLUMNS, p.block_kv), p.dtype, transforms=swizzled),
      plgpu.Barrier(num_barriers=2),
  ] if p.rounded_sum else []
  out = ([plgpu.SMEM((2, p.block_q, p.head_dim), p.dtype, transforms=swizzled)]
         if p.separate_out else [])
  return [
      plgpu.SMEM((2, p.block_q, p.head_dim), p.dtype, transforms=swizzled),
      plgpu.SMEM((p.stages, p.block_kv, p.head_dim), p.dtype, transforms=swizzled),
      plgpu.SMEM((p.stages, p.block_kv, p.head_dim), p.dtype, transforms=swizzled),
      plgpu.SMEM((2, p.block_q), jnp.float32),
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=p.stages),
      plgpu.Barrier(num_barriers=p.stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=p.stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=p.stages),
      plgpu.Barrier(num_arrivals=2),
      *rounded,
      *out,
  ]


class Scratch(NamedTuple):
  """forward_scratch's refs by name; ``out_smem2`` is Q's tiles unless
  ``separate_out``, the ones' refs None without ``rounded_sum``."""
  q_smem2: Any
  k_smem: Any
  v_smem: Any
  lse_smem2: Any
  q_loaded: Any
  k_loaded: Any
  v_loaded: Any
  k_free: Any
  v_free: Any
  schedule: Any
  ones_smem2: Any
  ones_loaded: Any
  out_smem2: Any


def scratch_of(p: ForwardParams, refs) -> Scratch:
  fixed, rest = list(refs[:10]), list(refs[10:])
  ones = [rest.pop(0), rest.pop(0)] if p.rounded_sum else [None, None]
  out = rest.pop(0) if p.separate_out else fixed[0]
  return Scratch(*fixed, *ones, out)


class Item(NamedTuple):
  """One work item, the 2 * block_q query rows of q tile ``tile`` of (batch
  ``bi``, query head ``h``): its key-tile range [lo, hi), the hull of both
  compute warpgroups' ranges, the calling warpgroup's own segment span, and
  ``delta``: how far the queries' positions lie after the keys' (the
  contract's q_offset; None for 0)."""
  bi: Any
  h: Any
  tile: Any
  kv_head: Any
  lo: Any
  hi: Any
  own_span: Any
  own_uniform: Any
  delta: Any


def work_item(p: ForwardParams, spans_ref, bi, h, tile, wg, delta) -> Item:
  hull, own_span, own_uniform = program_spans(spans_ref, bi, tile, wg)
  lo, hi = program_tiles(kv_tiles(
      p.spec_padded, tile * p.rows, p.rows, p.block_kv, p.padded, hull, delta=delta))
  return Item(bi, h, tile, lax.div(h, jnp.int32(p.spec.group_size)), lo, hi, own_span,
               own_uniform, delta)


def work(p: ForwardParams, spans_ref, wg, delta):
  """(count, item_of): the number of work items of this program and its i-th
  item. Persistent programs take items program, program + programs, ... in
  the order q tiles, heads, batch (the programs at work at once share a head's
  keys and values in L2); otherwise the program's one item is its grid
  position, its query tile launched_q_tile's (the last first under a causal
  mask)."""
  if not p.programs:
    item = work_item(p, spans_ref, lax.axis_index("batch"), lax.axis_index("heads"),
                     launched_q_tile(p.spec, p.q_tiles), wg, delta)
    return 1, lambda i: item
  program = lax.axis_index("programs")
  count = lax.div(jnp.int32(p.items + p.programs - 1) - program, jnp.int32(p.programs))

  def item_of(i):
    w = program + i * p.programs
    rest = lax.div(w, jnp.int32(p.q_tiles))
    return work_item(p, spans_ref, lax.div(rest, jnp.int32(p.spec.num_q_heads)),
                     lax.rem(rest, jnp.int32(p.spec.num_q_heads)),
                     lax.rem(w, jnp.int32(p.q_tiles)), wg, delta)

  return count, item_of


def over_items(count, item_of, body):
  """body(i, item, base) for each of ``count`` items, ``base`` the ring steps
  of the items before; returns the ring steps of all of them."""
  def step(i, base):
    item = item_of(i)
    body(i, item, base)
    return base + item.hi - item.lo

  if isinstance(count, int):  # one program per item
    return step(0, jnp.int32(0))
  return lax.fori_loop(0, count, step, jnp.int32(0))
