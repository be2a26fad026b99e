"""What the Mosaic GPU forward and backward kernels share: the memory
warpgroup's producer ring (producer_ring), tile logits and masks, tile ranges,
the warp-specialised kernel call, shared-memory accounting of a scratch list
(scratch_bytes), and the padded layout. The Mosaic GPU module and the calls
whose API differs across jax releases come from pallas_compat."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax.numpy as jnp
from jax import custom_batching, lax
from jax.experimental import pallas as pl

from ua_reference.contract import StaticSpec

from ..cap_forms import approx_math
from ..pallas_compat import load_vector, plgpu
from ..tile_math import TileMask, Tiles, scores_to_logits, visible_mask

# bfloat16 and float16: wgmma's 16-bit operands (float32 stays on Triton).
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Head dims are padded to a multiple of 64: one 128-byte swizzled row of
# 16-bit values.
HEAD_DIM_MULTIPLE = 64
# Shared memory one block may use on sm90 (H100, H200): 227 KiB.
MAX_SHARED_MEMORY = 232448
# Bytes of one mbarrier in shared memory.
BARRIER_BYTES = 8


def scratch_bytes(scratch) -> int:
  """Shared memory (bytes) of a kernel's scratch list as plgpu.kernel takes it:
  an SMEM entry takes prod(shape) * itemsize, a Barrier entry num_barriers *
  BARRIER_BYTES."""
  mgpu = plgpu()
  total = 0
  for entry in scratch:
    if isinstance(entry, mgpu.Barrier):
      total += math.prod(_as_shape(entry.num_barriers)) * BARRIER_BYTES
    else:
      total += math.prod(entry.shape) * jnp.dtype(entry.dtype).itemsize
  return total


def _as_shape(n) -> tuple[int, ...]:
  return tuple(n) if isinstance(n, (tuple, list)) else (n,)


def ring_slot(step, lo, stages: int):
  """The ring slot of ``step`` in a ring of ``stages`` slots whose first step
  is ``lo``."""
  return lax.rem(step - lo, jnp.int32(stages))


@dataclasses.dataclass(frozen=True)
class RingCopy:
  """One TMA copy of a producer_ring step: ``source(where)``, a global-memory
  ref (``where`` is what the ring's ``locate`` returned for the step), into
  slot s of ``buffer`` ([stages, ...] in shared memory), arriving at
  ``loaded.at[s]``."""
  source: Callable[[Any], Any]
  buffer: Any
  loaded: Any


def producer_ring(lo, hi, stages: int, locate: Callable[[Any], Any],
                  groups: Sequence[tuple[Any, Sequence[RingCopy]]]):
  """The memory warpgroup of a warp-specialised kernel: steps [lo, hi) copied by
  TMA into a ring of ``stages`` shared-memory slots (slot ring_slot(step, lo,
  stages)). Each of ``groups`` is (free, copies): from the step ``stages``
  after the first on, the ring waits for ``free.at[s]`` (the compute
  warpgroups' release of the slot) before issuing ``copies``; each copy
  arrives at its own loaded barrier. ``locate(step)`` is evaluated once per
  step, after its slot, for the copies' sources.

  After the last copy the ring observes the last release of every slot
  (ring_observe)."""
  plgpu().set_max_registers(40, action="decrease")
  ring_steps(lo, hi, lo, stages, locate, groups)
  ring_observe(hi - lo, stages, groups)


def ring_steps(lo, hi, origin, stages: int, locate: Callable[[Any], Any],
               groups: Sequence[tuple[Any, Sequence[RingCopy]]]):
  """producer_ring's copies of steps [lo, hi) of a ring whose step 0 is
  ``origin`` (lo - origin steps went before, for a persistent program's
  earlier work items): step ``step`` uses slot ring_slot(step, origin, stages)
  and waits for that slot's release from ``origin + stages`` on."""
  mgpu = plgpu()

  @pl.loop(lo, hi)
  def _(step):
    s = ring_slot(step, origin, stages)
    where = locate(step)
    for free, copies in groups:
      @pl.when(step >= origin + stages)
      def _():
        mgpu.barrier_wait(free.at[s])

      for copy in copies:
        mgpu.copy_gmem_to_smem(copy.source(where), copy.buffer.at[s], copy.loaded.at[s])


def ring_observe(steps, stages: int, groups: Sequence[tuple[Any, Sequence[RingCopy]]]):
  """After a ring's last of ``steps`` steps (counted from its origin), the
  memory warpgroup waits for the last release of every slot used: a barrier's
  final phase is waited for by each thread that waits on it (Mosaic's
  interpreter checks this), at no cost."""
  mgpu = plgpu()

  @pl.loop(jnp.maximum(steps - stages, 0), steps)
  def _(step):
    for free, _ in groups:
      mgpu.barrier_wait(free.at[ring_slot(step, 0, stages)])


def position_tiles(shape, q_start, k_start, query_axis: int):
  """(query positions, key positions) of a score tile in wgmma's layout, for
  tile_math.visible_mask; the tile holds queries along ``query_axis``."""
  mgpu = plgpu()
  iota = lambda axis: mgpu.broadcasted_iota(jnp.int32, shape, axis, layout=mgpu.Layout.WGMMA)
  return q_start + iota(query_axis), k_start + iota(1 - query_axis)


def tile_logits(spec: StaticSpec, scores, temp, q_start, k_start, *, masked: TileMask,
                seg_ref, batch, padded: bool, fast_cap: bool, query_axis: int = 0, delta=None):
  """The logits of a score tile (tile_math.scores_to_logits) whose queries
  start at ``q_start`` and keys at ``k_start``, along ``query_axis``, hidden
  by tile_math.visible_mask as ``masked`` (tile_loop's TileMask) says. The
  tile's segment ids are read here from ``seg_ref`` (None: no segment ids),
  only for a FULL mask: a read of global memory in the tile's critical path,
  which the tiles inside one run of one id (a causal diagonal inside a
  document) do not need. ``delta``: visible_mask's (the queries' offset)."""
  mask = None
  if masked:
    mgpu = plgpu()
    q_pos, k_pos = position_tiles(scores.shape, q_start, k_start, query_axis)
    q_len, k_len = scores.shape if query_axis == 0 else scores.shape[::-1]
    q_layout, k_layout = (mgpu.Layout.WGMMA.reduce(1 - query_axis),
                          mgpu.Layout.WGMMA.reduce(query_axis))
    q_seg, k_seg = ((load_vector(seg_ref.at[batch, pl.ds(q_start, q_len)], q_layout),
                     load_vector(seg_ref.at[batch, pl.ds(k_start, k_len)], k_layout))
                    if seg_ref is not None and masked is TileMask.FULL else (None, None))
    mask = visible_mask(spec, q_pos, k_pos, q_seg, k_seg, padded=padded, query_axis=query_axis,
                        delta=delta)
  return scores_to_logits(spec, scores, temp, mask, fast_cap, query_axis=query_axis)


def program_spans(ranges_ref, batch, program, warpgroup):
  """(hull, span, uniform) of a program whose two compute warpgroups own tiles
  2 * program and 2 * program + 1 of ``ranges_ref`` (segment_spans.tile_ranges,
  computed outside the kernels: a vector reduced to a scalar inside a Mosaic
  kernel goes through one shared-memory scratch area, which warpgroups reducing
  at once would share). ``hull`` is the smallest range holding both tiles'
  spans, for the program's tile range; ``span`` and ``uniform`` are those of
  ``warpgroup``'s own tile (the second's for the memory warpgroup, which uses
  only the hull), for tile_math's ``span`` and ``uniform``. Each a pair of
  scalars; (None, None, None) without segment ids (``ranges_ref`` None).

  All eight scalars are read here, at the start of the program's work item
  (of each item, in a persistent program), at once: read in
  two groups, the second after the query ids, they slowed the forward with
  segment ids down (docs/HISTORY.md, "The contract's options at
  speed")."""
  if ranges_ref is None:
    return None, None, None
  first, second = ([ranges_ref[batch, 2 * program + w, j] for j in range(4)] for w in (0, 1))
  hull = jnp.minimum(first[0], second[0]), jnp.maximum(first[1], second[1])
  own = [jnp.where(warpgroup == 0, a, b) for a, b in zip(first, second)]
  return hull, (own[0], own[1]), (own[2], own[3])


def tile_span(ranges_ref, batch, tile):
  """(span, uniform) of tile ``tile`` of segment_spans.tile_ranges'
  ``ranges_ref``, for a program that owns one tile (see program_spans);
  (None, None) without segment ids (``ranges_ref`` None)."""
  if ranges_ref is None:
    return None, None
  return ((ranges_ref[batch, tile, 0], ranges_ref[batch, tile, 1]),
          (ranges_ref[batch, tile, 2], ranges_ref[batch, tile, 3]))


def _skipping_nones(fn, operands):
  """(the operands that are not None, ``fn`` of those and any arguments after
  them, which receives None in the others' places)."""
  absent = [i for i, x in enumerate(operands) if x is None]

  def with_nones(*present):
    xs = list(present)
    for i in absent:
      xs.insert(i, None)
    return fn(*xs)

  return [x for x in operands if x is not None], with_nones


def kernel_call(body, **kernel_args):
  """plgpu.kernel(body, **kernel_args) as a function of operands of which
  some may be None (no segment ids, no temperature): those are left out of
  the kernel's call, and ``body`` receives None in their refs' places. An
  absent input passed as zeros would be a broadcast XLA materialises before
  every call (docs/HISTORY.md, "The contract's options at speed")."""
  def call(*operands):
    present, with_nones = _skipping_nones(body, operands)
    return plgpu().kernel(with_nones, **kernel_args)(*present)

  return call


def _compiler_params(spec: StaticSpec, fast_cap: bool):
  """The warp-specialised kernels' compiler parameters (cap_forms.approx_math)."""
  mgpu = plgpu()
  return mgpu.CompilerParams(approx_math=approx_math(spec, fast_cap),
                             lowering_semantics=mgpu.LoweringSemantics.Warpgroup)


def warp_specialized_call(body, *, spec: StaticSpec, fast_cap: bool, **kernel_args):
  """kernel_call of a body whose warpgroups 0 and 1 compute and 2 copies
  (thread axis "wg"), with the kernels' compiler parameters (cap_forms.approx_math)."""
  return kernel_call(body, num_threads=3, thread_name="wg",
                     compiler_params=_compiler_params(spec, fast_cap), **kernel_args)


def accumulating_call(body, *, spec: StaticSpec, fast_cap: bool, accumulator, out_type,
                      scratch_types, grid, grid_names, kernel_name: str):
  """warp_specialized_call of a body that also adds into an array of
  ``accumulator``'s shape and dtype, zeroed before the call and returned
  before the outputs; its ref follows the operands' refs. The array is a ref
  of pl.run_state, which pl.kernel aliases in and out: the state stays inside
  this call, so the custom VJP around it sees a pure function (a jax.new_ref
  there has no discharge rule through custom_jvp). plgpu.kernel's batching
  wrapper rejects a ref under jax 0.10, so the mesh is built here as
  plgpu.kernel builds it."""
  mesh = plgpu().Mesh(grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg",
                      kernel_name=kernel_name)

  def scoped(*refs):
    pl.run_scoped(functools.partial(body, *refs), *scratch_types, collective_axes="wg")

  def call(*operands):
    present, with_nones = _skipping_nones(scoped, operands)

    def stateful(refs):
      total, *out_refs = refs
      outs = pl.kernel(with_nones, out_type=out_type, mesh=mesh,
                       compiler_params=_compiler_params(spec, fast_cap),
                       name=kernel_name)(*present, total)
      for ref, out in zip(out_refs, outs):
        ref[...] = out

    zeros = lambda like: jnp.zeros(like.shape, like.dtype)
    return pl.run_state(stateful)((zeros(accumulator), *map(zeros, out_type)))

  return call


def batch_folded(fn):
  """``fn(*operands)``, each operand (None allowed) and output batched along
  axis 0, made to take jax.vmap by folding the mapped axis into that one
  (operands not mapped are broadcast): pl.run_state, around the kernel of
  accumulating_call, has no batching rule."""
  def call(*operands):
    present, with_nones = _skipping_nones(fn, operands)
    run = custom_batching.custom_vmap(with_nones)

    @run.def_vmap
    def _folded(axis_size, in_batched, *present):
      present = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                 for x, batched in zip(present, in_batched)]
      outs = run(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in present))
      return (tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs),
              (True,) * len(outs))

    return run(*present)

  return call


def own_tiles(tiles: Tiles, program_lo, program_hi) -> Tiles:
  """A warpgroup's Tiles (tile_math.kv_tiles/q_tiles) clipped into its
  program's [program_lo, program_hi), each bound clipped to lie between the
  one before and hi. A warpgroup drains the program's tiles outside its own
  range, so the two must nest: a warpgroup whose rows are all padding has an
  empty segment span, lo > hi, which would drain tiles twice or ones never
  loaded."""
  lo = jnp.clip(tiles.lo, program_lo, program_hi)
  hi = jnp.clip(tiles.hi, lo, program_hi)
  bounds = [lo]
  for bound in tiles.bounds[1:-1]:
    bounds.append(jnp.clip(bound, bounds[-1], hi))
  return Tiles((*bounds, hi), tiles.masks)


def launched_q_tile(spec: StaticSpec, q_tiles: int):
  """The query tile of this program (grid axis "q_tiles" of ``q_tiles``),
  the last first under a causal mask. The last tiles see the most keys;
  launched first, they no longer run alone at the end of the grid while the
  other multiprocessors idle (tokamax's sm90 forward orders its causal tiles
  the same way; docs/BENCHMARKS.md, "The causal launch order")."""
  tile = lax.axis_index("q_tiles")
  if spec.causal:
    return jnp.int32(q_tiles - 1) - tile
  return tile


def program_tiles(tiles: Tiles):
  """(lo, hi) of a program's tile range, hi >= lo."""
  return tiles.lo, jnp.maximum(tiles.hi, tiles.lo)


def swizzled():
  """The transforms of a 16-bit [rows, head_dim] tile in shared memory, as
  TMA writes it and wgmma reads it."""
  mgpu = plgpu()
  return (mgpu.TilingTransform((8, 64)), mgpu.SwizzleTransform(128))


def padded_head_dim(head_dim: int) -> int:
  return -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def padded_length(seq_len: int, *tile_rows: int) -> int:
  """The sequence length padded to a multiple of every program's rows."""
  step = math.lcm(*tile_rows)
  return -(-seq_len // step) * step


def dtype_error(dtype) -> str | None:
  if jnp.dtype(dtype) not in DTYPES:
    return f"the Mosaic backend takes bfloat16 and float16, not {jnp.dtype(dtype).name}"
  return None
