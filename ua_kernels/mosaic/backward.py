"""The backward kernels on Pallas Mosaic GPU, for Hopper (sm90): dq, and dk/dv
summed over a GQA group.

``backward`` pads the inputs and calls two of the four kernels, each with a
BackwardParams (its static parameters, holding its TileShape) and the scratch
of ``dq_scratch``/``dkv_scratch`` for that shape: ``dq_kernel`` and
``dkv_kernel``, or above head dim 128 ``dq_halves_kernel`` and
``dkv_halves_kernel``. ``halves_shared_memory`` and ``unsupported`` count the
halves kernels' shared memory from the same scratch lists
(common.scratch_bytes). The dq kernels are in dq.py, the dk/dv kernels in
dkv.py, what both take (tile shapes, parameters, scratch, the warpgroup steps)
in backward_parts.py.

All four have the forward's structure (ua_kernels.mosaic.forward): a program
has two compute warpgroups and a third that only issues TMA copies of the
streamed tiles into a ring of ``stages`` shared-memory slots
(common.producer_ring). A slot has a "loaded" barrier per buffer (TMA
arrives) and one "free" barrier that both compute warpgroups arrive at when
done with it. In dq_kernel and dkv_kernel each compute warpgroup owns one tile
and passes over the streamed tiles outside its own range ("drain"), as in the
forward, since a barrier's phase is tracked by each waiting thread.

dq: a program owns query rows of one query head and streams the key and
value tiles of their range: s = Q K^T and dp = dO V^T by wgmma, then
dq += ds K (``_dq_step``).

dk/dv: a program owns keys of one kv head and streams, for every query tile
of their range and every query head of the group (the group sum happens in
registers; no repeated K/V), the tiles of Q and dO and the per-query rows
(lse, delta, temperature) in one TMA copy. wgmma's A operand comes from
shared memory or registers and its B from shared memory, so the kernel scores
keys against queries, sT = K Q^T, and takes pT and dsT from registers for
dv += pT dO and dk += dsT Q (``_dkv_step``): its tiles hold queries along
axis 1 (tile_math's ``query_axis``).

Every rule of the contract comes from tile_math, shared with the Triton
kernels: scores_to_logits and visible_mask (through common.tile_logits,
as in the forward), probabilities, logits_grad (the cap's
derivative from the registry), matmul_operand (float16's range), and the tile
ranges q_tiles/kv_tiles (with segment ids, within the spans of the tile's
documents, and inside its run of one id masked by position only, or not at
all inside the band too).

The fused kernel (``fused``, ua_kernels.attention(deterministic=False);
dkv.dkv_dq_kernel) is dkv_kernel's program whose steps also compute dq's
share, ds K, from the ds tile they already hold (through shared memory, read
transposed by wgmma) and add it into a zeroed float32 dq in global memory by a
TMA reduce-add: five tile products a step, not the two kernels' seven, and dq's
sums in the order the copies arrive; or, ``ordered`` (MosaicTiles.ordered_fused,
deterministic), in the order of the key tiles: a counter per dq tile in global
memory, zeroed at each call, each compute warpgroup waiting for its turn,
adding, waiting for its add to land, and passing the turn on. Each share is
block_q x D float32, so the adds move 4 D T^2 / block_kv bytes per head
(32 GiB at T = 16k, 16 heads, D = 128 and 64-key tiles, half that causal),
against the L2. bfloat16 only: float16's per-query range scaling would need a
max across warps (backward_parts.fused_unsupported).

Head dims above 128 (up to 256, padded to 256): one warpgroup's dk and dv of
64 keys (or dq of 64 rows) would need 256 registers per thread, so
dq_halves_kernel and dkv_halves_kernel give a program one tile and each compute
warpgroup one half of the gradients' columns; both warpgroups compute the
scores and dp of the tile over the whole head dim. They share the steps
(``_dq_step``, ``_dkv_step``, whose ``part`` picks the column half) and the
memory warpgroups with the others; a program of one tile needs no drain.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ua_reference.contract import StaticSpec

from .. import fast_math
from . import common
from .config import MosaicTiles
from ..padding import pad
from ..segment_spans import tile_ranges
from .backward_parts import (BackwardParams, dkv_scratch, dq_scratch, fused_scratch, HALVES_ABOVE,
                             tile_shapes)
# What callers ask of the backward before they launch it (attention.backends_for, the tests).
from .backward_parts import (MAX_HEAD_DIM, fused_unsupported,  # noqa: F401
                             halves_shared_memory, unsupported)
from .dq import dq_halves_kernel, dq_kernel
from .dkv import dkv_dq_kernel, dkv_halves_kernel, dkv_kernel


def backward(spec: StaticSpec, tiles: MosaicTiles, q, k, v, seg, temp, shift, delta, dout, *,
             fast_cap: bool, kernels=("dq", "dkv"), fused: bool = False, ordered: bool = False):
  """(dq, dk, dv) of the unpadded inputs. ``shift`` [B, Hq, T] is the forward's
  row statistic (SoftmaxState.finalize without low), ``delta`` [B, Hq, T] = rowsum(dO * O) - dlse - w * lse (0 on rows
  without a visible key), ``temp`` [B, T, Hq] float32 or None. ``kernels``
  runs only some of the two (the others' outputs are None), so that
  benchmarks.breakdown times each on its own. ``fused``: one kernel,
  dkv.dkv_dq_kernel, in their place (backward_parts.fused_unsupported says
  where it runs); its dq is bitwise reproducible where ``ordered``."""
  if ordered and not fused:
    raise ValueError("mosaic.backward(ordered=True) orders the fused kernel's adds: it needs "
                     "fused=True")
  if fused and (why := fused_unsupported(spec, q.dtype, tiles)):
    raise ValueError(f"mosaic.backward(fused=True): {why}")
  if fused and set(kernels) != {"dq", "dkv"}:
    raise ValueError(f"mosaic.backward(fused=True) is one kernel; kernels={kernels!r} cannot "
                     f"run a part of it")
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  dtype = q.dtype
  halves = d > HALVES_ABOVE
  head_dim = 2 * HALVES_ABOVE if halves else common.padded_head_dim(d)
  seq_pad = common.padded_length(t, 2 * tiles.block_q_dq, tiles.block_kv_dq,
                                        tiles.block_q_dkv, 2 * tiles.block_kv_dkv)
  has_seg, has_temp = seg is not None, temp is not None

  q, k, v, dout = (pad(x, {1: seq_pad, 3: head_dim}) for x in (q, k, v, dout))
  # Each kernel reads the spans of its warpgroups' tiles (query tiles for dq,
  # key tiles for dk/dv); one array where both tiles have the same length.
  spans = {block: tile_ranges(seg, seq_pad, block) if has_seg else None
           for block in {tiles.block_q_dq, tiles.block_kv_dkv}}
  spans_dq, spans_dkv = spans[tiles.block_q_dq], spans[tiles.block_kv_dkv]
  seg = pad(seg, {1: seq_pad}) if has_seg else None
  # Per-query rows of each head, [B, Hq, R, T_pad]: the dk/dv kernel's TMA
  # warpgroup copies a query tile's lse, delta (and temperature) at once.
  row_vectors = [shift, delta] + ([jnp.transpose(temp, (0, 2, 1))] if has_temp else [])
  rows = pad(jnp.stack([x.astype(jnp.float32) for x in row_vectors], axis=2), {3: seq_pad})
  dq_shape, dkv_shape = tile_shapes(tiles, dtype, head_dim, num_rows=rows.shape[2],
                                    halves=halves)
  params = functools.partial(
      BackwardParams, spec,
      # Tile ranges count tiles over the padded length; masks use spec's own
      # seq_len (visible_mask's padded flag hides the padding).
      dataclasses.replace(spec, seq_len=seq_pad, kv_seq_len=seq_pad), seq_pad != t, has_temp, fast_cap)
  if fused:
    call = common.batch_folded(
        functools.partial(_fused, spec, fast_cap, params(dkv_shape), ordered))
    with fast_math.native("mosaic"):
      dq, dk, dv = call(q, k, v, dout, rows, seg, spans_dkv)
    return dq[:, :t, :, :d].astype(dtype), dk[:, :t, :, :d], dv[:, :t, :, :d]
  # A halves program owns one tile (each warpgroup half its columns), a
  # program of the others two tiles (one per warpgroup).
  per_program = 1 if halves else 2
  call = functools.partial(common.warp_specialized_call, spec=spec, fast_cap=fast_cap)
  dq_call = call(
      functools.partial(dq_halves_kernel if halves else dq_kernel, params(dq_shape)),
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=dq_scratch(dq_shape),
      grid=(hq, seq_pad // (per_program * dq_shape.block_q), b),
      grid_names=("heads", "q_tiles", "batch"),
      kernel_name="ua_backward_dq_halves_mosaic" if halves else "ua_backward_dq_mosaic",
  )
  dkv_call = call(
      functools.partial(dkv_halves_kernel if halves else dkv_kernel, params(dkv_shape)),
      out_type=(jax.ShapeDtypeStruct(k.shape, dtype),) * 2,
      scratch_types=dkv_scratch(dkv_shape),
      grid=(hkv, seq_pad // (per_program * dkv_shape.block_kv), b),
      grid_names=("heads", "kv_tiles", "batch"),
      kernel_name="ua_backward_dkv_halves_mosaic" if halves else "ua_backward_dkv_mosaic",
  )
  dq = dk = dv = None
  with fast_math.native("mosaic"):
    if "dq" in kernels:
      dq = dq_call(q, k, v, dout, rows, seg, spans_dq)[:, :t, :, :d]
    if "dkv" in kernels:
      dk, dv = (x[:, :t, :, :d] for x in dkv_call(q, k, v, dout, rows, seg, spans_dkv))
  return dq, dk, dv


def _fused(spec: StaticSpec, fast_cap: bool, params: BackwardParams, ordered: bool, q, k,
           *operands):
  """(dq, dk, dv) of the padded inputs by the fused kernel (dkv.dkv_dq_kernel):
  dkv_kernel's grid and outputs, and dq added up in a float32 array of q's
  shape. Shapes come from the operands: under jax.vmap (common.batch_folded)
  the batch holds the mapped axis too. ``ordered``: the key tiles outermost in
  the grid, so that the programs running at once hold a few key tiles of many
  heads, not the whole chain of one head's turns."""
  b, seq_pad, hq, head_dim = q.shape
  sizes = dict(heads=k.shape[2], kv_tiles=seq_pad // (2 * params.shape.block_kv), batch=b)
  names = ("kv_tiles", "heads", "batch") if ordered else ("heads", "kv_tiles", "batch")
  call = common.accumulating_call(
      functools.partial(dkv_dq_kernel, params, ordered=ordered), spec=spec, fast_cap=fast_cap,
      accumulator=jax.ShapeDtypeStruct((b, seq_pad, hq, head_dim), jnp.float32),
      out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2,
      scratch_types=fused_scratch(params.shape),
      grid=tuple(sizes[name] for name in names), grid_names=names,
      kernel_name="ua_backward_fused_ordered_mosaic" if ordered else "ua_backward_fused_mosaic")
  return call(q, k, *operands)
