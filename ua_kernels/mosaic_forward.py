"""The forward kernel on Pallas Mosaic GPU, for Hopper (sm90): TMA copies, wgmma,
and warpgroup specialisation, which Pallas-Triton does not emit.

Structure of JAX's ``attention_mgpu.py`` forward: a program owns 2 * block_q
query rows of one (batch, query head); three warpgroups share it. Two compute
warpgroups own block_q rows each; the third only issues TMA copies of key and
value tiles into a ring of ``stages`` shared-memory slots, guarded by a
"loaded" barrier per slot (TMA arrives) and a "free" one (both compute
warpgroups arrive). A schedule barrier alternates the compute warpgroups, so
one's softmax overlaps the other's matmuls.

Every masking and capping rule comes from tile_math, as in the Triton kernels:
the logits are tile_math.scores_to_logits of the wgmma's scores, the mask is
tile_math.visible_mask of position tiles (both through mosaic_common.tile_logits,
shared with the backward kernels), the online softmax is
SoftmaxState.step, and the key-tile ranges are tile_math.kv_tiles (causal and
window tiles outside the band, and with segment ids the tiles outside the spans
of a tile's documents, are never loaded; the fully visible ones run without a
mask, and those inside the query tile's run of one segment id are masked by
position only, without reading the ids). The memory warpgroup loads the hull
of both compute warpgroups' ranges; a compute warpgroup passes over tiles of that hull that
are outside its own range ("drain": it waits for and releases the slot, and
keeps the schedule barrier's count), since a barrier's phase is tracked by
each waiting thread and must not be skipped.

Outputs what the Triton forward does (out, base-2 lse per row), so either
backend's backward runs on this forward's residuals.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ua_reference.contract import StaticSpec

from . import fast_math, mosaic_common
from .mosaic_common import (load_vector, own_tiles, program_spans, tile_logits,
                            program_tiles)
from .kernel_config import MosaicTiles
from .padding import pad
from .segment_spans import tile_ranges
from .softmax_state import SoftmaxState
from .tile_math import fixed_shift, kv_tiles, tile_loop

# 256 is the largest head dim whose tiles fit the shared memory.
MAX_HEAD_DIM = 256


def unsupported(spec: StaticSpec, dtype) -> str | None:
  """Why the Mosaic forward cannot run this call (None: it can)."""
  if why := mosaic_common.dtype_error(dtype):
    return why
  if spec.head_dim > MAX_HEAD_DIM:
    return f"the Mosaic backend takes head dims up to {MAX_HEAD_DIM}, not {spec.head_dim}"
  return None


def forward(spec: StaticSpec, tiles: MosaicTiles, q, k, v, seg, temp, *, fast_cap: bool):
  """(out [B, T, Hq, D], lse2 [B, Hq, T] base 2) of the unpadded inputs;
  ``seg`` [B, T] int32 or None; ``temp`` [B, T, Hq] float32 or None."""
  plgpu = mosaic_common.plgpu()
  b, t, hq, d = q.shape
  group = spec.group_size
  dtype = q.dtype
  block_q = tiles.block_q
  head_dim = mosaic_common.padded_head_dim(d)
  block_kv = tiles.block_kv
  rows = 2 * block_q
  seq_pad = mosaic_common.padded_length(t, rows, block_kv)
  padded = seq_pad != t
  num_kv = seq_pad // block_kv
  stages = min(tiles.stages, num_kv)

  q, k, v = (pad(x, {1: seq_pad, 3: head_dim}) for x in (q, k, v))
  has_seg, has_temp = seg is not None, temp is not None
  spans = tile_ranges(seg, seq_pad, block_q) if has_seg else None
  seg = pad(seg, {1: seq_pad}) if has_seg else None
  temp = pad(jnp.transpose(temp, (0, 2, 1)), {2: seq_pad}) if has_temp else None
  shift = fixed_shift(spec, dtype, has_temp)
  # kv_tiles/kv_block_range count tiles over the padded length; masks use
  # spec's own seq_len (visible_mask's padded flag hides the padding).
  spec_padded = dataclasses.replace(spec, seq_len=seq_pad)
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def kernel(q_ref, k_ref, v_ref, seg_ref, spans_ref, temp_ref, out_ref, lse_ref,
             q_smem2, k_smem, v_smem, lse_smem2,
             q_loaded, k_loaded, v_loaded, k_free, v_free, schedule):
    bi = lax.axis_index("batch")
    h = lax.axis_index("heads")
    tile = lax.axis_index("q_tiles")
    wg = lax.axis_index("wg")
    kv_head = lax.div(h, jnp.int32(group))
    hull, own_span, own_uniform = program_spans(spans_ref, bi, tile, wg)
    cta_lo, cta_hi = program_tiles(kv_tiles(
        spec_padded, tile * rows, rows, block_kv, padded, hull))

    def slot(kb):
      return lax.rem(kb - cta_lo, jnp.int32(stages))

    def schedule_sync():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      q_smem, lse_smem = q_smem2.at[wg], lse_smem2.at[wg]
      q_start = tile * rows + wg * block_q
      plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_start, block_q), h], q_smem,
                              q_loaded.at[wg])
      q_temp = (load_vector(temp_ref.at[bi, h, pl.ds(q_start, block_q)], row_layout)
                if has_temp else None)
      plgpu.barrier_wait(q_loaded.at[wg])

      def drain(kb, carry):
        s = slot(kb)
        plgpu.barrier_wait(k_loaded.at[s])
        plgpu.barrier_arrive(k_free.at[s])
        schedule_sync()
        plgpu.barrier_wait(v_loaded.at[s])
        plgpu.barrier_arrive(v_free.at[s])
        schedule_sync()
        return carry

      def visit(kb, state, masked):
        s = slot(kb)
        plgpu.barrier_wait(k_loaded.at[s])

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[s].transpose((1, 0)))
          schedule_sync()
          return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[s])
        logits = tile_logits(spec, scores, q_temp, q_start, kb * block_kv, masked=masked,
                             seg_ref=seg_ref, batch=bi, padded=padded,
                             fast_cap=fast_cap)
        m, l, correction, p = state.step(logits, shift)
        acc = state.rescaled_acc(correction)
        p = p.astype(dtype)
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_loaded.at[s])
        plgpu.barrier_wait(schedule)

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p, v_smem.at[s])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[s])
        return SoftmaxState(m, l, acc)

      state = SoftmaxState(
          plgpu.layout_cast(jnp.full((block_q,), -jnp.inf if shift is None else shift,
                                     jnp.float32), row_layout),
          plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout),
          plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA))
      tiles = own_tiles(kv_tiles(
          spec_padded, q_start, block_q, block_kv, padded,
          own_span, own_uniform), cta_lo, cta_hi)
      pl.when(wg == 1)(schedule_sync)
      state = lax.fori_loop(cta_lo, tiles.lo, drain, state)
      state = tile_loop(tiles, visit, state)
      state = lax.fori_loop(tiles.hi, cta_hi, drain, state)
      pl.when(wg == 0)(schedule_sync)

      out, lse2 = state.finalize()
      q_smem[...] = out.astype(dtype)  # Q's buffer holds O on its way out
      lse_smem[...] = lse2
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, out_ref.at[bi, pl.ds(q_start, block_q), h])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, h, pl.ds(q_start, block_q)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      @pl.loop(cta_lo, cta_hi)
      def _(kb):
        s = slot(kb)
        rows_of = (bi, pl.ds(kb * block_kv, block_kv), kv_head)

        @pl.when(kb >= cta_lo + stages)
        def _():
          plgpu.barrier_wait(k_free.at[s])

        plgpu.copy_gmem_to_smem(k_ref.at[rows_of], k_smem.at[s], k_loaded.at[s])

        @pl.when(kb >= cta_lo + stages)
        def _():
          plgpu.barrier_wait(v_free.at[s])

        plgpu.copy_gmem_to_smem(v_ref.at[rows_of], v_smem.at[s], v_loaded.at[s])

      # Observe the last release of every slot: a barrier's final phase is
      # waited for by each thread that waits on it (Mosaic's interpreter
      # checks this), at no cost, after the last copy.
      @pl.loop(jnp.maximum(cta_hi - stages, cta_lo), cta_hi)
      def _(kb):
        plgpu.barrier_wait(k_free.at[slot(kb)])
        plgpu.barrier_wait(v_free.at[slot(kb)])

  swizzled = mosaic_common.swizzled()
  scratch = [
      plgpu.SMEM((2, block_q, head_dim), dtype, transforms=swizzled),
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled),
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled),
      plgpu.SMEM((2, block_q), jnp.float32),
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2),
  ]
  params = plgpu.CompilerParams(approx_math=mosaic_common.approx_math(spec, fast_cap),
                                lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  call = mosaic_common.kernel_call(
      kernel,
      out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((b, hq, seq_pad), jnp.float32)),
      scratch_types=scratch,
      grid=(hq, seq_pad // rows, b),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=3,
      thread_name="wg",
      compiler_params=params,
      kernel_name="ua_forward_mosaic",
  )
  with fast_math.native("mosaic"):
    out, lse2 = call(q, k, v, seg, spans, temp)
  return out[:, :t, :, :d], lse2[:, :, :t]
