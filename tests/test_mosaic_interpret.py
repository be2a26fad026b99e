"""The Mosaic GPU kernels run on the CPU by jax's Mosaic GPU interpreter (jax >= 0.11).

The interpreter executes the kernels' warpgroups as threads, with their
barriers, TMA copies and wgmma, so it checks numerics and synchronisation
without a GPU: each shape class of tests/test_mosaic.py runs the Mosaic
forward and backward here against the Triton kernels in Pallas' interpreter.
It lacks three things the kernels use, which the ``interpreter_gaps`` fixture
supplies for these tests only, computing the same products in registers:
``pl.run_state`` over an initialised wgmma accumulator, a wgmma operand in
registers (p and ds), and a store into an accumulator (the overlapped
forward's). The fused backward's TMA reduce-add, which it lacks too, the
``tma_reduce_add`` fixture supplies, and the ordered one's semaphores the
``turn_counters`` fixture. CI's jax 0.10 has no such interpreter and
skips them.
"""

import dataclasses
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ua_reference
from ua_reference.contract import validate, validate_call

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
if not hasattr(plgpu, "InterpretGPUParams"):
  pytest.skip("Mosaic GPU's interpreter needs jax >= 0.11", allow_module_level=True)

from jax.experimental import pallas as pl  # noqa: E402
from jax._src.pallas import core as pallas_core  # noqa: E402
from jax._src.state import types as state_types  # noqa: E402

from test_mosaic import (FUSED_CLASSES, OTHER_KEYS_CLASSES, SHAPE_CLASSES,  # noqa: E402
                         SINK_CLASSES,
                         _gpu_inputs, _other_keys_id, other_keys_inputs)
from ua_kernels import KernelConfig, MosaicTiles, cap_forms, devices  # noqa: E402
from ua_kernels.mosaic import backward as mosaic_backward  # noqa: E402
from ua_kernels.mosaic import common as mosaic_common  # noqa: E402
from ua_kernels.mosaic import forward as mosaic_forward  # noqa: E402
from ua_kernels.mosaic.tuned import mosaic_tiles  # noqa: E402
from ua_kernels.triton.launch import KeyBlock  # noqa: E402
from ua_kernels.tuned_configs import effective_config  # noqa: E402

attention_module = sys.modules["ua_kernels.attention"]


class _RegisterAccumulator:
  """Stands in for an initialised wgmma accumulator inside pl.run_state."""

  def __init__(self, value):
    self.value = value

  def __getitem__(self, index):
    return self.value

  def __setitem__(self, index, value):
    self.value = value


def _is_ref(x):
  return isinstance(x, pallas_core.TransformedRef) or isinstance(jax.typeof(x),
                                                                 state_types.AbstractRef)


@pytest.fixture
def interpreter_gaps(monkeypatch):
  real_wgmma, real_run_state = plgpu.wgmma, pl.run_state

  def run_state(body):
    def run(init):
      inits = init if isinstance(init, tuple) else (init,)
      if not all(hasattr(i, "_init") for i in inits):  # not an accumulator: the fused call's
        return real_run_state(body)(init)
      accs = tuple(_RegisterAccumulator(i._init) for i in inits)
      body(accs if isinstance(init, tuple) else accs[0])
      values = tuple(a.value for a in accs)
      return values if isinstance(init, tuple) else values[0]
    return run

  def wgmma(acc, a, b):
    if not isinstance(acc, _RegisterAccumulator):
      return real_wgmma(acc, a, b)
    a = a[...] if _is_ref(a) else a
    acc.value = acc.value + jnp.dot(a.astype(jnp.float32), b[...].astype(jnp.float32))

  real_run_scoped, real_load = pl.run_scoped, plgpu.wgmma_accumulator_load

  def run_scoped(body, *types, **kwargs):
    # Several accumulators in one scope: the overlapped forward's step, which
    # stores into them and issues a product from registers into one.
    if len(types) > 1 and all(isinstance(t, plgpu.WGMMAAccumulatorRef) for t in types):
      return body(*(_RegisterAccumulator(jnp.zeros(t.shape, t.dtype)) for t in types))
    return real_run_scoped(body, *types, **kwargs)

  def accumulator_load(acc, *, wait_n=0):
    return acc.value if isinstance(acc, _RegisterAccumulator) else real_load(acc, wait_n=wait_n)

  monkeypatch.setattr(pl, "run_state", run_state)
  monkeypatch.setattr(pl, "run_scoped", run_scoped)
  monkeypatch.setattr(plgpu, "wgmma", wgmma)
  monkeypatch.setattr(plgpu, "wgmma_accumulator_load", accumulator_load)


def _close(name, got, want, dtype, eps=None):
  """Within one rounding of the output dtype (or ``eps``) of each element, plus
  a quarter of one at the output's largest magnitude: the two kernels round the
  same probabilities to 16 bits after other running maxima (other tile sizes)
  and sum them in other orders, then round the results, which may fall on
  neighbouring values. A probability scaled by 1.02 in the dk/dv kernel fails
  eight of the ten classes with a Mosaic backward."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  finite = np.isfinite(want)
  assert np.array_equal(np.isfinite(got), finite), f"{name}: infinities differ"
  eps = eps or float(jnp.finfo(dtype).eps)
  scale = float(np.max(np.abs(want[finite]), initial=0.0))
  np.testing.assert_allclose(got[finite], want[finite], rtol=eps,
                             atol=eps / 4 * scale, err_msg=name)


# Other tilings than the defaults on a few classes: a third ring stage (also more
# stages than a program has steps, T=1), 64-key dq tiles and forward key tiles,
# 128-row forward and dk/dv query tiles; on a class with padding, a causal window
# and GQA 4/1 (T=200, float16) and on T=1. The T=384 and T=129 classes under these
# tilings took 110 of the interpreter's 505 CPU-seconds in CI; their features run
# at the default tiles above.
OTHER_TILINGS = [MosaicTiles(block_kv=64, stages=3, block_kv_dq=64, stages_bwd=3),
                 MosaicTiles(block_q=128, block_q_dkv=128)]
TILED_CLASSES = [SHAPE_CLASSES[i] for i in (2, 9)]


@pytest.mark.parametrize("shape_class", SHAPE_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_mosaic_kernels_match_triton_in_the_interpreters(shape_class, interpreter_gaps):
  _compare(shape_class, MosaicTiles())


@pytest.mark.parametrize("tiles", OTHER_TILINGS, ids=["stages3-kv64", "q128"])
@pytest.mark.parametrize("shape_class", TILED_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_other_tilings_match_triton_in_the_interpreters(shape_class, tiles, interpreter_gaps):
  _compare(shape_class, tiles)


def test_a_program_of_padding_keys_matches_triton(interpreter_gaps):
  """Causal packed documents with 128-row dq tiles: the padded length leaves
  the last dk/dv program only padding keys, whose empty span gives it no
  query tiles, and warpgroups of padding keys beside real ones, which drain
  all of their program's tiles."""
  shape_class, tiles = SHAPE_CLASSES[10], MosaicTiles(block_q_dq=128)
  assert shape_class[-1] == dict(segment_ids=True, causal=True)
  b, t, hq, hkv, d, dtype, _ = shape_class
  x = jnp.zeros((b, t, hq, d), dtype)
  spec = validate(x, x, x, causal=True)[0]
  tiles = effective_config(spec, dtype, KernelConfig(mosaic=tiles)).mosaic
  seq_pad = mosaic_common.padded_length(t, 2 * tiles.block_q_dq, tiles.block_kv_dq,
                                        tiles.block_q_dkv, 2 * tiles.block_kv_dkv)
  assert seq_pad - t >= 2 * tiles.block_kv_dkv
  _compare(shape_class, tiles)


# Persistent forwards of several work items per program (multiprocessors()
# patched to 4): the K/V ring runs on from one item into the next at every
# offset of its slots, the next item's Q is loaded during an item's epilogue,
# through O's own buffer (head dim 64) or Q's (256, whose O does not fit
# beside it); causal masks (which the table runs one program per item) and
# packed documents give the items unequal ranges, with drained tiles.
PERSISTENT_CLASSES = [
    (2, 384, 3, 3, 64, jnp.bfloat16, {}),
    (1, 300, 3, 1, 256, jnp.float16, dict(cap_method="tanh", cap_params=(5.0,))),
    (1, 384, 2, 2, 128, jnp.bfloat16, dict(causal=True)),
    (3, 300, 2, 1, 64, jnp.bfloat16, dict(segment_ids=True, causal=True)),
    (3, 300, 2, 1, 64, jnp.bfloat16, dict(segment_ids=True)),
    (1, 300, 3, 1, 256, jnp.float16, dict(segment_ids=True)),
]


@pytest.mark.parametrize("shape_class", PERSISTENT_CLASSES,
                         ids=lambda c: f"T{c[1]}-D{c[4]}-{'-'.join(sorted(c[6])) or 'plain'}")
def test_a_persistent_forward_of_several_items_per_program_matches_triton(
    shape_class, interpreter_gaps, monkeypatch):
  monkeypatch.setattr(devices, "multiprocessors", lambda: 4)
  b, t, hq, _, d, dtype, _ = shape_class
  tiles = MosaicTiles(persistent=True)
  x = jnp.zeros((b, t, hq, d), dtype)
  filled = effective_config(validate(x, x, x)[0], dtype, KernelConfig(mosaic=tiles)).mosaic
  items = b * hq * mosaic_common.padded_length(t, 2 * filled.block_q, filled.block_kv) // (
      2 * filled.block_q)
  assert items > 4 and items % 4, "every program takes several items, not all as many"
  _compare(shape_class, tiles, backward=False)


# The forward the table does not pick (MosaicTiles.overlap_softmax above
# head dim 64) on every shape class, so both forwards see each mask kind as a
# warpgroup's first tile (the overlapped one's switch), warpgroups with no
# tile (padding rows, empty spans), drained tiles, the rounded sum's third
# product (a cap in 16 bits), one tile (T=1), and persistent programs.
@pytest.mark.parametrize("shape_class", SHAPE_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_the_other_forward_matches_triton_in_the_interpreters(shape_class, interpreter_gaps):
  (q, k, v), inputs, options = _gpu_inputs(shape_class)
  overlapped = mosaic_tiles(validate(q, k, v, **options, **inputs)[0], q.dtype).overlap_softmax
  _compare(shape_class, MosaicTiles(overlap_softmax=not overlapped), backward=False)


@pytest.mark.parametrize("shape_class", PERSISTENT_CLASSES[:2],
                         ids=lambda c: f"T{c[1]}-D{c[4]}-{'-'.join(sorted(c[6])) or 'plain'}")
def test_a_persistent_overlapped_forward_matches_triton(shape_class, interpreter_gaps,
                                                        monkeypatch):
  monkeypatch.setattr(devices, "multiprocessors", lambda: 4)
  _compare(shape_class, MosaicTiles(persistent=True, overlap_softmax=True), backward=False)


def _forward_against_triton(q, k, v, options):
  """The Mosaic forward (the table's tiles) against the Triton forward, both
  interpreted, on a call of the contract's full signature as
  ua_kernels.attention makes it: keys of another length or an offset as a
  KeyBlock, the offset traced."""
  call = validate_call(q, k, v, **options)
  spec, seg, sinks = call.spec, call.segment_ids, call.sinks
  temp = None if call.temperature is None else call.temperature.astype(jnp.float32)
  keys = None
  if spec.kv_seq_len != spec.seq_len or spec.q_offset != 0:
    keys = KeyBlock(None, jnp.asarray(call.q_offset, jnp.int32))
    spec = dataclasses.replace(spec, q_offset=None)
  triton = effective_config(spec, q.dtype, KernelConfig(backend="triton", interpret=True))
  tiles = effective_config(spec, q.dtype, KernelConfig()).mosaic
  out, shift, low = attention_module._forward(spec, triton, attention_module.Backends(
      "triton", "triton"), q, k, v, seg, temp, keys=keys, sinks=sinks)
  fast_cap = cap_forms.fast_cap(spec, q.dtype)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    out_m, shift_m = mosaic_forward.forward(spec, tiles, q, k, v, seg, temp, fast_cap=fast_cap,
                                            sinks=sinks,
                                            offset=None if keys is None else keys.offset)
  _close("out", out_m, out, q.dtype)
  _close_lse2(attention_module._lse2(spec, temp, shift_m, None),
              attention_module._lse2(spec, temp, shift, low), fast_cap)
  return out_m, shift_m


def _close_lse2(got, want, fast_cap):
  """The two forwards' base-2 lse. A fast cap form: the Triton interpreter
  rounds its tanh to 11 bits (the error of tanh.approx, ua_kernels.fast_math),
  Mosaic's interpreter does not. Else four float32 roundings: the two kernels
  sum a row's l in other orders (docs/TOLERANCES.md, "The interpreters' lse2":
  3 ulps measured under jax 0.12.0.1)."""
  _close("lse2", got, want, jnp.float32,
         eps=2.0 ** -11 if fast_cap else 4 * float(jnp.finfo(jnp.float32).eps))


@pytest.mark.parametrize("shape_class", SINK_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_the_forward_with_sinks_matches_triton_in_the_interpreters(shape_class,
                                                                   interpreter_gaps):
  """The sinks' part of the forward, each head's sink joining its rows' mass
  (and a cap's rounded row sum) after the key loop, against the Triton
  forward's (both forwards the table picks: the persistent one for the packed
  class). The backward takes no sink
  (test_mosaic.test_sinks_lower_to_the_mosaic_kernels)."""
  (q, k, v), inputs, options = _gpu_inputs(shape_class)
  _forward_against_triton(q, k, v, {**options, **inputs})


@pytest.mark.parametrize("shape_class", OTHER_KEYS_CLASSES, ids=_other_keys_id)
def test_the_forward_of_other_keys_matches_triton_in_the_interpreters(shape_class,
                                                                      interpreter_gaps):
  """Keys of another length or an offset (tile ranges and masks shifted by
  the traced offset, each side padded to its own tiles); the class with rows
  before every key gives them out 0 and lse -inf, as the contract says."""
  (q, k, v), options = other_keys_inputs(shape_class)
  out, shift = _forward_against_triton(q, k, v, options)
  if options.get("q_offset", 0) < 0:
    hidden = -options["q_offset"]
    assert not np.any(np.asarray(out[:, :hidden], np.float32))
    assert np.all(np.asarray(shift[:, :, :hidden]) == -np.inf)


def _compare(shape_class, tiles, backward=True, fused=False, ordered=False):
  _compare_inputs(*_gpu_inputs(shape_class), tiles, backward, fused=fused, ordered=ordered)


def _far_apart_tiles():
  """float16 inputs whose rows' largest |ds| lie far apart from one tile to the
  next, both ways. Queries and keys share a large common part (logits near
  1.3e4 at temperature 40 and sm_scale 1/4: with a z-loss of 1, the own
  tiles' |ds| reach 2^16, past float16's range) and differ by a small part of
  opposite sign between the two halves (the other half's logits 60 lower:
  |ds| near 2^-72 there, still normal in float32). Every float16 dq and dk row
  is then rescaled in place (mosaic.backward_parts._accumulate) by 2^57 to 2^65, up
  in the first half's rows and keys, down in the second's."""
  b, t, h, d = 1, 256, 2, 64
  rng = np.random.default_rng(3)
  side = np.where(np.arange(t) < t // 2, 1.0, -1.0)[None, :, None, None]
  common = np.r_[np.full(d // 2, 36.0 / np.sqrt(d // 2)), np.zeros(d // 2)]
  apart = np.r_[np.zeros(d // 2), np.full(d // 2, np.sqrt(3.0 / (d // 2)))]
  q, k = (common + side * apart + 0.01 * rng.normal(size=(b, t, h, d)) for _ in range(2))
  v = rng.normal(size=(b, t, h, d))
  qkv = tuple(jnp.asarray(x, jnp.float16) for x in (q, k, v))
  temperature = jnp.full((b, t, h), 40.0, jnp.float32)
  return qkv, {"temperature": temperature}, {"z_loss_weight": 1.0, "sm_scale": 0.25}


def test_float16_rows_rescaled_across_far_apart_tiles_match_triton(interpreter_gaps):
  """The gradients against Triton's as everywhere; the output against the
  float64 reference instead: logits near 1.3e4 carry float32 roundings of
  about 2^-10 each, so both kernels' outputs are exact only to a few float16
  roundings, and which neighbouring values each lands on depends on the CPU
  (docs/TOLERANCES.md, "Outputs of logits near 1.3e4")."""
  qkv, inputs, options = _far_apart_tiles()
  with jax.enable_x64(True):
    out64 = np.asarray(ua_reference.attention(*(np.asarray(x, np.float64) for x in qkv),
                                              **{**options, **inputs}))
  _compare_inputs(qkv, inputs, options, MosaicTiles(), out_reference=out64)


def _no_worse_than(name, got, other, reference, dtype):
  """``got`` at most one rounding of ``dtype`` at the reference's largest
  magnitude further from ``reference`` than ``other`` is."""
  got, other = (np.asarray(x, np.float64) for x in (got, other))
  assert np.array_equal(np.isfinite(got), np.isfinite(reference)), f"{name}: infinities differ"
  finite = np.isfinite(reference)
  err, other_err = (np.max(np.abs(x[finite] - reference[finite])) for x in (got, other))
  scale = float(np.max(np.abs(reference[finite])))
  assert err <= other_err + float(jnp.finfo(dtype).eps) * scale, (
      f"{name}: Mosaic error {err:.3g} against float64, Triton {other_err:.3g}")


def _compare_inputs(qkv, inputs, options, tiles, backward=True, out_reference=None,
                    fused=False, ordered=False):
  q, k, v = qkv
  spec, seg, temp = validate(q, k, v, **options, **inputs)
  temp = None if temp is None else temp.astype(jnp.float32)
  triton = effective_config(spec, q.dtype, KernelConfig(backend="triton", interpret=True))
  tiles = effective_config(spec, q.dtype, KernelConfig(mosaic=tiles)).mosaic
  fast_cap = cap_forms.fast_cap(spec, q.dtype)
  on_triton = attention_module.Backends("triton", "triton")
  out, shift, low = attention_module._forward(spec, triton, on_triton, q, k, v, seg, temp)
  lse2 = attention_module._lse2(spec, temp, shift, low)
  rng = np.random.default_rng(1)
  dout = jnp.asarray(rng.normal(size=q.shape), q.dtype)
  dlse = jnp.asarray(rng.normal(size=lse2.shape), jnp.float32)
  grads = attention_module._backward(spec, triton, on_triton, q, k, v, seg, temp, out, shift,
                                     low, dout, dlse)

  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    out_m, shift_m = mosaic_forward.forward(spec, tiles, q, k, v, seg, temp, fast_cap=fast_cap)
    lse2_m = attention_module._lse2(spec, temp, shift_m, None)
    if backward and mosaic_backward.unsupported(spec, q.dtype) is None:
      delta = attention_module._delta(spec, out, dout, lse2, dlse)
      grads_m = mosaic_backward.backward(spec, tiles, q, k, v, seg, temp, shift, delta, dout,
                                         fast_cap=fast_cap, fused=fused, ordered=ordered)
    else:
      grads_m = None
  if out_reference is None:
    _close("out", out_m, out, q.dtype)
  else:
    _no_worse_than("out", out_m, out, out_reference, q.dtype)
  _close_lse2(lse2_m, lse2, fast_cap)
  if grads_m is not None:
    for name, got, want in zip(("dq", "dk", "dv"), grads_m, grads):
      _close(name, got, want, q.dtype)


@pytest.fixture
def tma_reduce_add(monkeypatch):
  """The interpreter lacks a TMA store's reduction (copy_smem_to_gmem's
  reduction_op), which the fused backward's dq takes: supplied here, for
  "add", as a read of the destination, the sum, and a write, under one lock
  (the interpreter runs a copy at its issue, in the issuing thread)."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  adding, lock = threading.local(), threading.Lock()
  real_copy, real_task = gpu_callbacks.copy_smem_to_gmem, gpu_callbacks.AsyncCopySmemToGmemTask

  class AddingTask(real_task):
    def __call__(self, tma_thread_id):
      if not getattr(adding, "on", False):
        return super().__call__(tma_thread_id)
      memory = gpu_callbacks._get_shared_memory()
      with lock:
        share, _, _ = memory.get_buffer_content(self.src_allocation_key, self.src_access,
                                                self.thread)
        total, _, _ = memory.get_buffer_content(self.dst_allocation_key, self.dst_access,
                                                self.thread)
        memory.store_buffer_content(self.dst_allocation_key, self.dst_access, total + share,
                                    self.thread)

  def copy(*, reduction_op=None, **kwargs):
    assert reduction_op in (None, "add"), reduction_op
    adding.on = reduction_op == "add"
    try:
      return real_copy(reduction_op=None, **kwargs)
    finally:
      adding.on = False

  monkeypatch.setattr(gpu_callbacks, "copy_smem_to_gmem", copy)
  monkeypatch.setattr(gpu_callbacks, "AsyncCopySmemToGmemTask", AddingTask)


@pytest.fixture
def turn_counters(monkeypatch):
  """The interpreter lacks semaphores, which the ordered fused backward's turns
  take (pl.get_global, pl.semaphore_wait and _signal): supplied here as
  counters on the host, a wait blocking its warpgroup's thread until its turn
  (the interpreter runs a program's warpgroups as threads and its programs one
  after another, in the grid's order). Yields (counts, faults): the turns
  taken per (batch, head, query tile), and what went wrong: a signal from a
  rank whose turn it was not, a counter outside the shape allocated, or a turn
  that did not come within 20 s (a deadlock on the GPU; the waits go on
  without blocking after it). Faults are
  recorded, not raised: an exception in a warpgroup's thread would leave the
  others waiting on its barriers."""
  from jax.experimental import io_callback
  counts, faults, shapes, changed = {}, [], [], threading.Condition()

  class View:
    def __init__(self, index):
      self.index, self.rank = index, None

  class Counters:
    def __init__(self, shape):
      self.at = type("At", (), {"__getitem__": lambda _, index: View(index)})()
      shapes.append(shape)

  def wait(value, *index):
    key = tuple(int(i) for i in index)
    with changed:
      if not all(0 <= i < n for i, n in zip(key, shapes[-1])):
        faults.append(f"counter {key} outside the {shapes[-1]} allocated")
      if faults or changed.wait_for(lambda: counts.get(key, 0) >= int(value), timeout=20):
        return
      faults.append(f"turn {int(value)} of counter {key} never came "
                    f"({counts.get(key, 0)} turns taken)")

  def signal(rank, *index):
    key = tuple(int(i) for i in index)
    with changed:
      if counts.get(key, 0) != int(rank):
        faults.append(f"rank {int(rank)} signalled counter {key} at {counts.get(key, 0)}")
      counts[key] = counts.get(key, 0) + 1
      changed.notify_all()

  def semaphore_wait(view, value, *, decrement=True):
    assert not decrement
    view.rank = value
    io_callback(wait, None, value, *view.index)

  def semaphore_signal(view, inc=1):
    assert inc == 1 and view.rank is not None, "a signal before its turn's wait"
    io_callback(signal, None, view.rank, *view.index)

  monkeypatch.setattr(pl, "get_global", lambda what: Counters(tuple(what.shape)))
  monkeypatch.setattr(pl, "semaphore_wait", semaphore_wait)
  monkeypatch.setattr(pl, "semaphore_signal", semaphore_signal)
  yield counts, faults


@pytest.mark.parametrize("shape_class", FUSED_CLASSES[2:], ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_the_fused_backward_matches_triton_in_the_interpreters(shape_class, interpreter_gaps,
                                                               tma_reduce_add):
  """Unordered, on the class of the unbiased rounding (the other two run
  ordered below: the same kernel but for how a share's add is timed)."""
  _compare(shape_class, MosaicTiles(), fused=True)


# And GQA under a causal mask at T = 100 with dq tiles of 2 x 128 rows: the length pads to
# 256, and the last key program holds only padding (its range empty: every turn passed).
ORDERED_CASES = [(c, MosaicTiles()) for c in FUSED_CLASSES[:2]] + [
    ((1, 100, 4, 2, 64, jnp.bfloat16, dict(causal=True)), MosaicTiles(block_q_dq=128))]


@pytest.mark.parametrize("shape_class, tiles", ORDERED_CASES,
                         ids=lambda c: f"T{c[1]}-D{c[4]}" if isinstance(c, tuple) else "")
def test_the_ordered_fused_backward_takes_every_turn_in_order(shape_class, tiles,
                                                              interpreter_gaps, tma_reduce_add,
                                                              turn_counters):
  """MosaicTiles.ordered_fused: its gradients as Triton's, each counter's
  turns taken by ranks 0, 1, 2, ... in that order (turn_counters), and every
  one of the kernel's 2 x (key tiles) compute warpgroups of a head taking
  every turn of its query tiles: GQA under a causal mask (turns passed before
  a program's query tiles) and packed documents in a window (turns passed in
  the tiles a warpgroup drains)."""
  (q, k, v), inputs, options = _gpu_inputs(shape_class)
  counts, faults = turn_counters
  _compare(shape_class, tiles, fused=True, ordered=True)
  assert not faults, faults[:5]
  tiles = effective_config(validate(q, k, v, **options, **inputs)[0], q.dtype,
                           KernelConfig(mosaic=tiles)).mosaic
  b, t, hq, _ = q.shape
  seq_pad = mosaic_common.padded_length(t, 2 * tiles.block_q_dq, tiles.block_kv_dq,
                                        tiles.block_q_dkv, 2 * tiles.block_kv_dkv)
  ranks = seq_pad // tiles.block_kv_dkv
  want = {(bi, h, qt): ranks for bi in range(b) for h in range(hq)
          for qt in range(seq_pad // tiles.block_q_dkv)}
  assert counts == want

