"""The backward kernels on Pallas Mosaic GPU, for Hopper (sm90): dq, and dk/dv
summed over a GQA group.

Both have the forward's structure (ua_kernels.mosaic_forward): a program has
two compute warpgroups, each owning one tile, and a third that only issues TMA
copies of the streamed tiles into a ring of ``stages`` shared-memory slots. A
slot has a "loaded" barrier per buffer (TMA arrives) and one "free" barrier
that both compute warpgroups arrive at when done with it. A compute warpgroup
passes over the streamed tiles outside its own range ("drain"), as in the
forward, since a barrier's phase is tracked by each waiting thread.

dq: a program owns 2 * block_q query rows of one query head and streams the
key and value tiles of their range: s = Q K^T and dp = dO V^T by wgmma, then
dq += ds K.

dk/dv: a program owns 2 * block_kv keys of one kv head and streams, for every
query tile of their range and every query head of the group (the group sum
happens in registers; no repeated K/V), the tiles of Q and dO and the
per-query rows (lse, delta, temperature) in one TMA copy. wgmma's A operand
comes from shared memory or registers and its B from shared memory, so the
kernel scores keys against queries, sT = K Q^T, and takes pT and dsT from
registers for dv += pT dO and dk += dsT Q: its tiles hold queries along axis 1
(tile_math's ``query_axis``).

Every rule of the contract comes from tile_math, shared with the Triton
kernels: scores_to_logits and visible_mask (through mosaic_common.tile_logits,
as in the forward), probabilities, logits_grad (the cap's
derivative from the registry), matmul_operand (float16's range), and the tile
ranges q_tiles/kv_tiles (with segment ids, within the spans of the tile's
documents, and inside its run of one id masked by position only, or not at
all inside the band too).

Head dims above 128 (up to 256, padded to 256): one warpgroup's dk and dv of
64 keys (or dq of 64 rows) would need 256 registers per thread, so
dq_halves_kernel and dkv_halves_kernel give a program one tile and each compute
warpgroup one half of the gradients' columns; both warpgroups compute the
scores and dp of the tile over the whole head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ua_reference.contract import StaticSpec

from . import fast_math, mosaic_common
from .kernel_config import MosaicTiles
from .mosaic_common import (load_vector, own_tiles, program_spans, tile_logits,
                            program_tiles, tile_span)
from .padding import pad
from .segment_spans import tile_ranges
from .tile_math import (kv_tiles, logits_grad, matmul_operand, probabilities, q_tiles,
                        scaled_back, tile_loop)

MAX_HEAD_DIM = 256
# Above this head dim both kernels split the gradients' columns between their
# two compute warpgroups (dq_halves_kernel, dkv_halves_kernel), on a head dim
# padded to 2 * 128.
HALVES_ABOVE = 128


def unsupported(spec: StaticSpec, dtype, tiles: MosaicTiles | None = None) -> str | None:
  """Why the Mosaic backward cannot run this call (None: it can); with
  ``tiles``, also whether they fit the halves kernels' shared memory."""
  if why := mosaic_common.dtype_error(dtype):
    return why
  if spec.head_dim > MAX_HEAD_DIM:
    return (f"the Mosaic backward takes head dims up to {MAX_HEAD_DIM}, not "
            f"{spec.head_dim}")
  if tiles is not None and spec.head_dim > HALVES_ABOVE:
    need = halves_shared_memory(tiles, jnp.dtype(dtype).itemsize)
    if need > mosaic_common.MAX_SHARED_MEMORY:
      return (f"at head dims above {HALVES_ABOVE} the Mosaic backward with {tiles} needs "
              f"{need} bytes of shared memory, more than the "
              f"{mosaic_common.MAX_SHARED_MEMORY} of a block")
  return None


def halves_shared_memory(tiles: MosaicTiles, itemsize: int) -> int:
  """Shared memory (bytes) of the larger of dq_halves_kernel and
  dkv_halves_kernel with ``tiles``, as their scratch below declares it
  (head dim 2 * HALVES_ABOVE, three per-query rows, 8-byte barriers). Tiles
  that pass MosaicTiles' validation can exceed a block's shared memory here
  (128-row tiles, three stages), which the dispatch sends to Triton.
  ``tiles`` filled (tuned_configs.effective_config)."""
  tiles.require_filled("mosaic_backward.halves_shared_memory")
  head_dim, stages = 2 * HALVES_ABOVE, tiles.stages_bwd
  bkv_halves = min(tiles.block_kv_dq, 64)
  dq = (2 * 2 * tiles.block_q_dq * (head_dim // 2) * itemsize
        + 2 * stages * bkv_halves * head_dim * itemsize
        + (5 + 3 * stages) * mosaic_common.BARRIER_BYTES)
  dkv = (2 * 2 * tiles.block_kv_dkv * (head_dim // 2) * itemsize
         + 2 * stages * tiles.block_q_dkv * head_dim * itemsize
         + stages * 3 * tiles.block_q_dkv * 4
         + (5 + 4 * stages) * mosaic_common.BARRIER_BYTES)
  return max(dq, dkv)


def _accumulate(plgpu, acc, a, b_smem, back):
  """acc + a @ b by wgmma; with matmul_operand's factor ``back`` the product
  is taken from zero and its rows scaled back before the sum."""
  product = lambda acc_ref: plgpu.wgmma(acc_ref, a, b_smem)
  if back is None:
    return pl.run_state(product)(plgpu.ACC.init(acc))
  zeros = plgpu.layout_cast(jnp.zeros(acc.shape, jnp.float32), plgpu.Layout.WGMMA)
  return acc + scaled_back(pl.run_state(product)(plgpu.ACC.init(zeros)), back)


def _scores_pair(plgpu, a1, b1, a2, b2, shape):
  """(a1 @ b1, a2 @ b2) in float32, both wgmmas issued before either is waited for."""
  def both(acc1, acc2):
    plgpu.wgmma(acc1, a1, b1)
    plgpu.wgmma(acc2, a2, b2)
    return acc1[...], acc2[...]

  return pl.run_scoped(both, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def backward(spec: StaticSpec, tiles: MosaicTiles, q, k, v, seg, temp, lse2, delta, dout, *,
             fast_cap: bool, kernels=("dq", "dkv")):
  """(dq, dk, dv) of the unpadded inputs. ``lse2`` [B, Hq, T] is the forward's
  base-2 lse, ``delta`` [B, Hq, T] = rowsum(dO * O) - dlse - w * lse (0 on rows
  without a visible key), ``temp`` [B, T, Hq] float32 or None. ``kernels``
  runs only some of the two (the others' outputs are None), so that
  benchmarks.breakdown times each on its own."""
  plgpu = mosaic_common.plgpu()
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  group = spec.group_size
  dtype = q.dtype
  halves = d > HALVES_ABOVE
  head_dim = 2 * HALVES_ABOVE if halves else mosaic_common.padded_head_dim(d)
  bq_dq, bkv_dq = tiles.block_q_dq, tiles.block_kv_dq
  # The dq halves kernel streams at most 64 keys per tile (two stages of
  # 128 keys at head dim 256 do not fit beside the query halves).
  bkv_halves = min(bkv_dq, 64)
  bq_dkv, bkv_dkv = tiles.block_q_dkv, tiles.block_kv_dkv
  seq_pad = mosaic_common.padded_length(t, 2 * bq_dq, bkv_dq, bq_dkv, 2 * bkv_dkv)
  padded = seq_pad != t
  stages = tiles.stages_bwd

  q, k, v, dout = (pad(x, {1: seq_pad, 3: head_dim}) for x in (q, k, v, dout))
  has_seg, has_temp = seg is not None, temp is not None
  # Each kernel reads the spans of its warpgroups' tiles (query tiles for dq,
  # key tiles for dk/dv); one array where both tiles have the same length.
  spans = {block: tile_ranges(seg, seq_pad, block) if has_seg else None
           for block in {bq_dq, bkv_dkv}}
  spans_dq, spans_dkv = spans[bq_dq], spans[bkv_dkv]
  seg = pad(seg, {1: seq_pad}) if has_seg else None
  # Per-query rows of each head, [B, Hq, R, T_pad]: the dk/dv kernel's TMA
  # warpgroup copies a query tile's lse, delta (and temperature) at once.
  row_vectors = [lse2, delta] + ([jnp.transpose(temp, (0, 2, 1))] if has_temp else [])
  rows = pad(jnp.stack([x.astype(jnp.float32) for x in row_vectors], axis=2), {3: seq_pad})
  num_rows = rows.shape[2]
  LSE, DELTA, TEMP = 0, 1, 2
  # Tile ranges count tiles over the padded length; masks use spec's own
  # seq_len (visible_mask's padded flag hides the padding).
  spec_padded = dataclasses.replace(spec, seq_len=seq_pad)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  swizzled = mosaic_common.swizzled()
  params = plgpu.CompilerParams(approx_math=mosaic_common.approx_math(spec, fast_cap),
                                lowering_semantics=plgpu.LoweringSemantics.Warpgroup)

  def dq_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref, dq_ref,
                q_smem2, do_smem2, k_smem, v_smem,
                q_loaded, do_loaded, k_loaded, v_loaded, kv_free):
    bq, bkv = bq_dq, bkv_dq
    bi = lax.axis_index("batch")
    h = lax.axis_index("heads")
    tile = lax.axis_index("q_tiles")
    wg = lax.axis_index("wg")
    kv_head = lax.div(h, jnp.int32(group))
    hull, own_span, own_uniform = program_spans(spans_ref, bi, tile, wg)
    cta_lo, cta_hi = program_tiles(kv_tiles(
        spec_padded, tile * 2 * bq, 2 * bq, bkv, padded, hull))
    slot = lambda kb: lax.rem(kb - cta_lo, jnp.int32(stages))

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      q_start = tile * 2 * bq + wg * bq
      own = (bi, pl.ds(q_start, bq), h)
      plgpu.copy_gmem_to_smem(q_ref.at[own], q_smem, q_loaded.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[own], do_smem, do_loaded.at[wg])
      row = lambda i: load_vector(rows_ref.at[bi, h, i, pl.ds(q_start, bq)], row_layout)
      lse2_q, delta_q = row(LSE), row(DELTA)
      temp_q = row(TEMP) if has_temp else None
      plgpu.barrier_wait(q_loaded.at[wg])
      plgpu.barrier_wait(do_loaded.at[wg])

      def drain(kb, dq):
        s = slot(kb)
        plgpu.barrier_wait(k_loaded.at[s])
        plgpu.barrier_wait(v_loaded.at[s])
        plgpu.barrier_arrive(kv_free.at[s])
        return dq

      def visit(kb, dq, masked):
        s = slot(kb)
        plgpu.barrier_wait(k_loaded.at[s])
        plgpu.barrier_wait(v_loaded.at[s])
        scores, dp = _scores_pair(plgpu, q_smem, k_smem.at[s].transpose((1, 0)),
                                  do_smem, v_smem.at[s].transpose((1, 0)), (bq, bkv))
        logits = tile_logits(spec, scores, temp_q, q_start, kb * bkv, masked=masked,
                             seg_ref=seg_ref, batch=bi, padded=padded,
                             fast_cap=fast_cap)
        p = probabilities(logits, lse2_q)
        ds = logits_grad(spec, p, dp, delta_q, logits, temp_q, fast_cap)
        ds16, back = matmul_operand(ds, dtype, axis=1)
        dq = _accumulate(plgpu, dq, ds16, k_smem.at[s], back)
        plgpu.barrier_arrive(kv_free.at[s])
        return dq

      dq = plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32), plgpu.Layout.WGMMA)
      tiles = own_tiles(kv_tiles(
          spec_padded, q_start, bq, bkv, padded,
          own_span, own_uniform), cta_lo, cta_hi)
      dq = lax.fori_loop(cta_lo, tiles.lo, drain, dq)
      dq = tile_loop(tiles, visit, dq)
      dq = lax.fori_loop(tiles.hi, cta_hi, drain, dq)
      q_smem[...] = dq.astype(dtype)  # Q's buffer holds dq on its way out
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[own])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      stream_keys(bi, kv_head, cta_lo, cta_hi, slot, bkv, k_ref, v_ref, k_smem, v_smem,
                  k_loaded, v_loaded, kv_free)

  def stream_keys(bi, kv_head, lo, hi, slot, bkv, k_ref, v_ref, k_smem, v_smem,
                  k_loaded, v_loaded, kv_free):
    """The dq kernels' memory warpgroup: key tiles [lo, hi) of ``bkv`` keys into
    the ring of K and V tiles."""
    plgpu.set_max_registers(40, action="decrease")

    @pl.loop(lo, hi)
    def _(kb):
      s = slot(kb)
      keys = (bi, pl.ds(kb * bkv, bkv), kv_head)

      @pl.when(kb >= lo + stages)
      def _():
        plgpu.barrier_wait(kv_free.at[s])

      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[s], k_loaded.at[s])
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[s], v_loaded.at[s])

    @pl.loop(jnp.maximum(hi - stages, lo), hi)
    def _(kb):  # the last release of every slot (mosaic_forward)
      plgpu.barrier_wait(kv_free.at[slot(kb)])

  # What the two halves kernels share: a program's own tiles (Q and dO for dq,
  # K and V for dk/dv) sit in shared memory as two column halves; both compute
  # warpgroups score them against the streamed tiles over both halves; each
  # warpgroup writes its half of the gradients out through its own tiles' half.
  half = head_dim // 2
  column_half = lambda part: pl.ds(part * half, half)

  def load_halves(refs, halves, own, loaded):
    """The program's own tiles of ``refs`` into their [2, rows, half]
    buffers, buffer i's half c arriving at barrier 2 * i + c."""
    for c in range(2):
      for i, (ref, buffer) in enumerate(zip(refs, halves)):
        plgpu.copy_gmem_to_smem(ref.at[own + (column_half(c),)], buffer.at[c],
                                loaded.at[2 * i + c])

  def halves_scores_pair(a_halves, b_ring, c_halves, d_ring, s, shape):
    """(A B^T, C D^T) over both column halves, A and C the program's own
    halves, B and D slot ``s`` of the streamed rings; both wgmmas issued
    before either is waited for."""
    def both(acc1, acc2):
      for c in range(2):
        plgpu.wgmma(acc1, a_halves.at[c], b_ring.at[s, :, column_half(c)].transpose((1, 0)))
        plgpu.wgmma(acc2, c_halves.at[c], d_ring.at[s, :, column_half(c)].transpose((1, 0)))
      return acc1[...], acc2[...]
    return pl.run_scoped(both, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))

  def store_halves(part, computed, outputs, own):
    """Warpgroup ``part``'s half of each gradient in ``outputs`` (the own
    tiles' halves buffer, which holds it on its way out; the output ref; the
    value) written out, once both warpgroups are done reading the own tiles."""
    plgpu.barrier_arrive(computed)
    plgpu.barrier_wait(computed)
    for halves, _, value in outputs:
      halves[part] = value.astype(dtype)
    plgpu.commit_smem()
    for halves, ref, _ in outputs:
      plgpu.copy_smem_to_gmem(halves.at[part], ref.at[own + (column_half(part),)])
    plgpu.wait_smem_to_gmem(0)

  def run_halves(wg, compute, memory):
    """Warpgroups 0 and 1 run ``compute(part)`` for their half, 2 ``memory()``."""
    for part in (0, 1):
      @pl.when(wg == part)
      def _(part=part):
        plgpu.set_max_registers(232, action="increase")
        compute(part)

    pl.when(wg == 2)(memory)

  def dq_halves_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref, dq_ref,
                       q_halves, do_halves, k_smem, v_smem,
                       qdo_loaded, k_loaded, v_loaded, kv_free, computed):
    """dq at head dims above 128: a program owns block_q query rows, and each
    compute warpgroup accumulates one half of dq's columns (dkv_halves_kernel's
    split); both compute the scores and dp over the whole head dim. Key tiles
    of at most 64 keys, so that the K/V ring fits the shared memory."""
    bq, bkv = bq_dq, bkv_halves
    bi = lax.axis_index("batch")
    h = lax.axis_index("heads")
    tile = lax.axis_index("q_tiles")
    wg = lax.axis_index("wg")
    kv_head = lax.div(h, jnp.int32(group))
    q_start = tile * bq
    tiles_ = kv_tiles(spec_padded, q_start, bq, bkv, padded,
                      *tile_span(spans_ref, bi, tile))
    lo, hi = program_tiles(tiles_)
    tiles_ = own_tiles(tiles_, lo, hi)
    slot = lambda kb: lax.rem(kb - lo, jnp.int32(stages))
    own = (bi, pl.ds(q_start, bq), h)

    def compute(part):
      if part == 0:  # one warpgroup loads the shared Q and dO halves
        load_halves((q_ref, do_ref), (q_halves, do_halves), own, qdo_loaded)
      row = lambda i: load_vector(rows_ref.at[bi, h, i, pl.ds(q_start, bq)], row_layout)
      lse2_q, delta_q = row(LSE), row(DELTA)
      temp_q = row(TEMP) if has_temp else None
      for i in range(4):
        plgpu.barrier_wait(qdo_loaded.at[i])

      def visit(kb, dq, masked):
        s = slot(kb)
        plgpu.barrier_wait(k_loaded.at[s])
        plgpu.barrier_wait(v_loaded.at[s])
        # s = Q K^T and dp = dO V^T
        scores, dp = halves_scores_pair(q_halves, k_smem, do_halves, v_smem, s, (bq, bkv))
        logits = tile_logits(spec, scores, temp_q, q_start, kb * bkv, masked=masked,
                             seg_ref=seg_ref, batch=bi, padded=padded,
                             fast_cap=fast_cap)
        p = probabilities(logits, lse2_q)
        ds = logits_grad(spec, p, dp, delta_q, logits, temp_q, fast_cap)
        ds16, back = matmul_operand(ds, dtype, axis=1)
        dq = _accumulate(plgpu, dq, ds16, k_smem.at[s, :, column_half(part)], back)
        plgpu.barrier_arrive(kv_free.at[s])
        return dq

      dq = plgpu.layout_cast(jnp.zeros((bq, half), jnp.float32), plgpu.Layout.WGMMA)
      dq = tile_loop(tiles_, visit, dq)
      store_halves(part, computed, [(q_halves, dq_ref, dq)], own)

    run_halves(wg, compute, lambda: stream_keys(
        bi, kv_head, lo, hi, slot, bkv, k_ref, v_ref, k_smem, v_smem, k_loaded, v_loaded,
        kv_free))

  def dkv_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref, dk_ref, dv_ref,
                 k_smem2, v_smem2, q_smem, do_smem, rows_smem,
                 k_loaded, v_loaded, q_loaded, do_loaded, rows_loaded, q_free):
    bq, bkv = bq_dkv, bkv_dkv
    bi = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    tile = lax.axis_index("kv_tiles")
    wg = lax.axis_index("wg")
    hull, own_span, own_uniform = program_spans(spans_ref, bi, tile, wg)
    cta_lo, cta_hi = program_tiles(q_tiles(
        spec_padded, tile * 2 * bkv, bq, 2 * bkv, padded, hull))
    # The streamed steps: step n is query tile n // group of query head
    # kv_head * group + n % group.
    first, last = cta_lo * group, cta_hi * group
    slot = lambda n: lax.rem(n - first, jnp.int32(stages))

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      k_start = tile * 2 * bkv + wg * bkv
      own = (bi, pl.ds(k_start, bkv), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[own], k_smem, k_loaded.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[own], v_smem, v_loaded.at[wg])
      plgpu.barrier_wait(k_loaded.at[wg])
      plgpu.barrier_wait(v_loaded.at[wg])

      def drain(n, carry):
        s = slot(n)
        plgpu.barrier_wait(q_loaded.at[s])
        plgpu.barrier_wait(do_loaded.at[s])
        plgpu.barrier_wait(rows_loaded.at[s])
        plgpu.barrier_arrive(q_free.at[s])
        return carry

      def visit(qb, g, carry, masked):
        dk, dv = carry
        s = slot(qb * group + g)
        q_start = qb * bq
        plgpu.barrier_wait(q_loaded.at[s])
        plgpu.barrier_wait(do_loaded.at[s])
        scores_t, dp_t = _scores_pair(plgpu, k_smem, q_smem.at[s].transpose((1, 0)),
                                      v_smem, do_smem.at[s].transpose((1, 0)), (bkv, bq))
        plgpu.barrier_wait(rows_loaded.at[s])
        row = lambda i: load_vector(rows_smem.at[s, i], col_layout)
        lse2_q, delta_q = row(LSE), row(DELTA)
        temp_q = row(TEMP) if has_temp else None
        logits = tile_logits(spec, scores_t, temp_q, q_start, k_start, masked=masked,
                             seg_ref=seg_ref, batch=bi, padded=padded,
                             fast_cap=fast_cap, query_axis=1)
        p_t = probabilities(logits, lse2_q)
        dv = _accumulate(plgpu, dv, p_t.astype(dtype), do_smem.at[s], None)
        ds_t = logits_grad(spec, p_t, dp_t, delta_q, logits, temp_q, fast_cap)
        ds16, back = matmul_operand(ds_t, dtype, axis=1)
        dk = _accumulate(plgpu, dk, ds16, q_smem.at[s], back)
        plgpu.barrier_arrive(q_free.at[s])
        return dk, dv

      def query_tile(qb, carry, masked):
        return lax.fori_loop(0, group, lambda g, c: visit(qb, g, c, masked), carry)

      zeros = plgpu.layout_cast(jnp.zeros((bkv, head_dim), jnp.float32), plgpu.Layout.WGMMA)
      tiles = own_tiles(q_tiles(
          spec_padded, k_start, bq, bkv, padded,
          own_span, own_uniform), cta_lo, cta_hi)
      carry = lax.fori_loop(first, tiles.lo * group, drain, (zeros, zeros))
      carry = tile_loop(tiles, query_tile, carry)
      dk, dv = lax.fori_loop(tiles.hi * group, last, drain, carry)
      k_smem[...] = dk.astype(dtype)  # K's and V's buffers hold dk, dv on their way out
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[own])
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[own])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      stream_queries(bi, kv_head, first, last, slot, q_ref, do_ref, rows_ref,
                     q_smem, do_smem, rows_smem, q_loaded, do_loaded, rows_loaded, q_free)

  def stream_queries(bi, kv_head, first, last, slot, q_ref, do_ref, rows_ref,
                     q_smem, do_smem, rows_smem, q_loaded, do_loaded, rows_loaded, q_free):
    """The dk/dv kernels' memory warpgroup: steps [first, last) into the ring of
    Q, dO and rows tiles (step n: query tile n // group of query head
    kv_head * group + n % group)."""
    bq = bq_dkv
    plgpu.set_max_registers(40, action="decrease")

    @pl.loop(first, last)
    def _(n):
      s = slot(n)
      qb = lax.div(n, jnp.int32(group))
      h = kv_head * group + lax.rem(n, jnp.int32(group))
      queries = (bi, pl.ds(qb * bq, bq), h)

      @pl.when(n >= first + stages)
      def _():
        plgpu.barrier_wait(q_free.at[s])

      plgpu.copy_gmem_to_smem(q_ref.at[queries], q_smem.at[s], q_loaded.at[s])
      plgpu.copy_gmem_to_smem(do_ref.at[queries], do_smem.at[s], do_loaded.at[s])
      plgpu.copy_gmem_to_smem(rows_ref.at[bi, h, :, pl.ds(qb * bq, bq)], rows_smem.at[s],
                              rows_loaded.at[s])

    @pl.loop(jnp.maximum(last - stages, first), last)
    def _(n):  # the last release of every slot (mosaic_forward)
      plgpu.barrier_wait(q_free.at[slot(n)])

  def dkv_halves_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref, dk_ref,
                        dv_ref, k_halves, v_halves, q_smem, do_smem, rows_smem,
                        kv_loaded, q_loaded, do_loaded, rows_loaded, q_free, computed):
    """dk/dv at head dims above 128: a program owns block_kv keys, and each
    compute warpgroup accumulates one half of dk's and dv's columns (128 each),
    since a warpgroup's whole dk and dv of 64 keys would take 256 registers per
    thread. Both compute the scores and dp over the whole head dim: 3 tile
    matmuls of 64 x 256 per warpgroup and step where the split by keys does 2.
    K and V sit in shared memory as two column halves, so that each
    warpgroup's dk and dv go out from a contiguous buffer."""
    bq, bkv = bq_dkv, bkv_dkv
    bi = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    tile = lax.axis_index("kv_tiles")
    wg = lax.axis_index("wg")
    k_start = tile * bkv
    tiles_ = q_tiles(spec_padded, k_start, bq, bkv, padded,
                     *tile_span(spans_ref, bi, tile))
    lo, hi = program_tiles(tiles_)
    tiles_ = own_tiles(tiles_, lo, hi)
    first, last = lo * group, hi * group
    slot = lambda n: lax.rem(n - first, jnp.int32(stages))
    own = (bi, pl.ds(k_start, bkv), kv_head)

    def compute(part):
      if part == 0:  # one warpgroup loads the shared K and V halves
        load_halves((k_ref, v_ref), (k_halves, v_halves), own, kv_loaded)

      for i in range(4):
        plgpu.barrier_wait(kv_loaded.at[i])

      def visit(qb, g, carry, masked):
        dk, dv = carry
        s = slot(qb * group + g)
        q_start = qb * bq
        plgpu.barrier_wait(q_loaded.at[s])
        plgpu.barrier_wait(do_loaded.at[s])
        # sT = K Q^T and dpT = V dO^T
        scores_t, dp_t = halves_scores_pair(k_halves, q_smem, v_halves, do_smem, s, (bkv, bq))
        plgpu.barrier_wait(rows_loaded.at[s])
        row = lambda i: load_vector(rows_smem.at[s, i], col_layout)
        lse2_q, delta_q = row(LSE), row(DELTA)
        temp_q = row(TEMP) if has_temp else None
        logits = tile_logits(spec, scores_t, temp_q, q_start, k_start, masked=masked,
                             seg_ref=seg_ref, batch=bi, padded=padded,
                             fast_cap=fast_cap, query_axis=1)
        p_t = probabilities(logits, lse2_q)
        dv = _accumulate(plgpu, dv, p_t.astype(dtype), do_smem.at[s, :, column_half(part)],
                         None)
        ds_t = logits_grad(spec, p_t, dp_t, delta_q, logits, temp_q, fast_cap)
        ds16, back = matmul_operand(ds_t, dtype, axis=1)
        dk = _accumulate(plgpu, dk, ds16, q_smem.at[s, :, column_half(part)], back)
        plgpu.barrier_arrive(q_free.at[s])
        return dk, dv

      def query_tile(qb, carry, masked):
        return lax.fori_loop(0, group, lambda g, c: visit(qb, g, c, masked), carry)

      zeros = plgpu.layout_cast(jnp.zeros((bkv, half), jnp.float32), plgpu.Layout.WGMMA)
      dk, dv = tile_loop(tiles_, query_tile, (zeros, zeros))
      store_halves(part, computed, [(k_halves, dk_ref, dk), (v_halves, dv_ref, dv)], own)

    run_halves(wg, compute, lambda: stream_queries(
        bi, kv_head, first, last, slot, q_ref, do_ref, rows_ref, q_smem, do_smem, rows_smem,
        q_loaded, do_loaded, rows_loaded, q_free))

  def _warp_specialized(body, *, out_type, scratch_types, grid, grid_names, kernel_name):
    """The kernel (mosaic_common.kernel_call) of a body whose warpgroups 0 and 1
    compute and 2 copies."""
    return mosaic_common.kernel_call(body, out_type=out_type, scratch_types=scratch_types,
                                     grid=grid, grid_names=grid_names, num_threads=3,
                                     thread_name="wg", compiler_params=params,
                                     kernel_name=kernel_name)

  dq_call = _warp_specialized(
      dq_kernel,
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=[
          plgpu.SMEM((2, bq_dq, head_dim), dtype, transforms=swizzled),
          plgpu.SMEM((2, bq_dq, head_dim), dtype, transforms=swizzled),
          plgpu.SMEM((stages, bkv_dq, head_dim), dtype, transforms=swizzled),
          plgpu.SMEM((stages, bkv_dq, head_dim), dtype, transforms=swizzled),
          plgpu.Barrier(num_barriers=2),
          plgpu.Barrier(num_barriers=2),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      ],
      grid=(hq, seq_pad // (2 * bq_dq), b),
      grid_names=("heads", "q_tiles", "batch"),
      kernel_name="ua_backward_dq_mosaic",
  )
  dkv_call = _warp_specialized(
      dkv_kernel,
      out_type=(jax.ShapeDtypeStruct(k.shape, dtype),) * 2,
      scratch_types=[
          plgpu.SMEM((2, bkv_dkv, head_dim), dtype, transforms=swizzled),
          plgpu.SMEM((2, bkv_dkv, head_dim), dtype, transforms=swizzled),
          plgpu.SMEM((stages, bq_dkv, head_dim), dtype, transforms=swizzled),
          plgpu.SMEM((stages, bq_dkv, head_dim), dtype, transforms=swizzled),
          plgpu.SMEM((stages, num_rows, bq_dkv), jnp.float32),
          plgpu.Barrier(num_barriers=2),
          plgpu.Barrier(num_barriers=2),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      ],
      grid=(hkv, seq_pad // (2 * bkv_dkv), b),
      grid_names=("heads", "kv_tiles", "batch"),
      kernel_name="ua_backward_dkv_mosaic",
  )
  if halves:
    dq_call = _warp_specialized(
        dq_halves_kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=[
            plgpu.SMEM((2, bq_dq, head_dim // 2), dtype, transforms=swizzled),
            plgpu.SMEM((2, bq_dq, head_dim // 2), dtype, transforms=swizzled),
            plgpu.SMEM((stages, bkv_halves, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((stages, bkv_halves, head_dim), dtype, transforms=swizzled),
            plgpu.Barrier(num_barriers=4),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ],
        grid=(hq, seq_pad // bq_dq, b),
        grid_names=("heads", "q_tiles", "batch"),
        kernel_name="ua_backward_dq_halves_mosaic",
    )
    dkv_call = _warp_specialized(
        dkv_halves_kernel,
        out_type=(jax.ShapeDtypeStruct(k.shape, dtype),) * 2,
        scratch_types=[
            plgpu.SMEM((2, bkv_dkv, head_dim // 2), dtype, transforms=swizzled),
            plgpu.SMEM((2, bkv_dkv, head_dim // 2), dtype, transforms=swizzled),
            plgpu.SMEM((stages, bq_dkv, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((stages, bq_dkv, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((stages, num_rows, bq_dkv), jnp.float32),
            plgpu.Barrier(num_barriers=4),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ],
        grid=(hkv, seq_pad // bkv_dkv, b),
        grid_names=("heads", "kv_tiles", "batch"),
        kernel_name="ua_backward_dkv_halves_mosaic",
    )
  dq = dk = dv = None
  with fast_math.native("mosaic"):
    if "dq" in kernels:
      dq = dq_call(q, k, v, dout, rows, seg, spans_dq)[:, :t, :, :d]
    if "dkv" in kernels:
      dk, dv = (x[:, :t, :, :d] for x in dkv_call(q, k, v, dout, rows, seg, spans_dkv))
  return dq, dk, dv
