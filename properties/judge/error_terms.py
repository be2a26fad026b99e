"""Per-element rounding allowances: the absolute values each output element sums.

A computed dot product is off by at most a few unit roundoffs times the sum of
its terms' absolute values, ``u * sum |a_i b_i|`` (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., section 3.1), not times the
largest value of the output. The float64 oracle evaluates those sums for every
element of every output, so that an element whose terms cancel keeps the
allowance of its terms and every other element gets one of its own size
(docs/TOLERANCES.md, "Per-element floors").

For query row i, key j (p the oracle's probabilities, z the logits, t the
temperature, s the softmax scale, c' the cap's derivative):

- ``sums``: out ``sum_j p |v_j|``; dv ``sum_i p |dO_i|``; dk ``sum_i |ds| |q_i|``
  with ``|ds| = p (|dp_ij - delta_i| + D_i) |s t c'|``: ds as rounded to the
  input dtype, and the error of the row correction a FlashAttention-style
  backward forms from its own (rounded) out,
  ``D_i = sum_j p |dO_i|.|v_j| + |dlse_i| + w |lse_i|``; dq the same, except that
  delta_i's error, one number per row, scales all of the row's ds alike and
  reaches dq_i as ``D_i |s t| |sum_j p c' k_j|``, signs kept;
- ``logit``: the same sums with p weighted by the error of ``z - lse`` behind
  it, times ds's own factor ``|dp - delta| + D_i`` in dq and dk. For lse: the
  float32 dots of the logits, ``u32 |s t| ||q_i|| ||k_j||`` per pair (the
  Cauchy-Schwarz bound the lse floor was measured to need, docs/TOLERANCES.md),
  p-weighted. For the other outputs: ``recompute (|z_ij| + |lse_i|)``, a logit
  and an lse one rounding away from the forward's (a FlashAttention-style
  backward recomputes p); in dq the lse's part, again one factor per row, as
  ``recompute |lse_i| |dq_i|``. Their dots' rounding is the same-precision
  reference's too, and ALPHA times its error covers it. Both with, for 16-bit
  inputs with a cap, a cap form's own error (``form``, properties/checks/cap_checks.py):
  ``form`` times the largest cap parameter in the cap's value, ``form`` in its
  derivative (``|ds|`` with ``|c'|`` replaced by it). dq and dk also with the
  float32 dot ``dp = dO_i.v_j`` (``u32 (|dO_i|.|v_j| + D_i)``), and with the
  cap's derivative step: ``|ds|`` with ``|c'|`` replaced by how far c' moves
  within a logit's rounding (1 for a hard cap's logit on its step;
  docs/TOLERANCES.md, "A derivative step within a logit's rounding").
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ua_reference.contract import validate_call
from ua_reference.reference import visible_keys


@dataclasses.dataclass(frozen=True)
class Rounding:
  """The errors the logit terms count: ``logit`` the relative error of a
  float32 dot (of its terms' sum); ``recompute`` of a logit recomputed in a
  backward; ``form`` a cap form's (0 where none applies); ``subnormal`` the
  absolute rounding of a probability or a ds below the input dtype's normal
  range (float16: 2^-24; 0 where that range is float32's); ``flush`` the
  threshold below which a GPU's float32 (and bfloat16, of float32's range)
  flushes a probability or a ds to zero, 2^-126: such a p loses at most
  itself, min(p, flush)."""

  logit: float
  recompute: float
  form: float = 0.0
  subnormal: float = 0.0
  flush: float = 0.0


# Compile options of the harness's own executables (the oracle, the same-precision
# reference, these terms; not the implementation's): no autotuning of their
# dots, and float32 dots on cuBLAS rather than XLA's Triton GEMM emitter, whose
# FMA kernels made the float32 reference compile about 4x as long on the H200
# (docs/VERIFICATION.md, "Where the compile seconds go").
HARNESS_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def harness_compiler_options(float64: bool) -> dict:
  """The compile options of the oracle (``float64``) or of the same-precision
  reference. Where the CPU is the backend, a case's oracle costs its compile, not its
  run: LLVM at level 0 compiles it faster than it slows its run, and moves its
  values by float64 ulps (README.md, "Tests"). The reference keeps
  the default (its rounding sizes the tolerances), as does an accelerator (a
  TPU's oracle runs long rows on its host)."""
  if float64 and jax.default_backend() == "cpu":
    return {**HARNESS_COMPILER_OPTIONS, "xla_backend_optimization_level": 0}
  return HARNESS_COMPILER_OPTIONS

# Largest [B, Hq, rows, T] block of pair terms computed at once (2^24 float64: 128 MiB,
# up to about twenty live at a time with a cap's derivative step).
TERMS_LOGITS = 1 << 24


def spec_of(case, inputs):
  """The contract's Validated call of a case (ua_reference.validate_call)."""
  return validate_call(
      jnp.asarray(inputs["q"]), jnp.asarray(inputs["k"]), jnp.asarray(inputs["v"]),
      segment_ids=inputs["segment_ids"], kv_segment_ids=inputs.get("kv_segment_ids"),
      q_offset=case.q_offset, sinks=inputs.get("sinks"), temperature=inputs["temperature"],
      causal=case.causal, window_len=case.window_len, cap_method=case.cap_method,
      cap_params=case.cap_params, sm_scale=case.sm_scale, z_loss_weight=case.z_loss_weight,
      return_lse=case.return_lse)


def element_terms(case, inputs: dict, lse, rounding: Rounding, rows=None):
  """({output: sums}, {output: logit terms}) as float64 numpy arrays of the
  outputs' shapes (lse: only logit terms). ``lse``: the oracle's [B, Hq, Tq]
  lse. ``rows``: only these query rows (lse of them alone; their row outputs,
  and the key outputs summed over them: sampled.py, whose other rows have zero
  cotangents). Call under x64."""
  call = spec_of(case, inputs)
  spec = call.spec
  f64 = lambda x: np.asarray(x, np.float64)
  # Sampled rows are taken before the float64 copy: at T = 256k a full one is 17 GB.
  at_rows = (lambda x: x) if rows is None else (lambda x: np.asarray(x)[:, rows])
  q, dout = f64(at_rows(inputs["q"])), f64(at_rows(inputs["dout"]))
  k, v = f64(inputs["k"]), f64(inputs["v"])
  g = spec.group_size
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  b, hq, d = q.shape[0], q.shape[2], q.shape[3]
  t_all, tk = spec.seq_len, k.shape[1]
  dlse = f64(inputs["dlse"]) if case.return_lse else np.zeros((b, hq, t_all))
  temp = np.ones((b, t_all, hq)) if call.temperature is None else \
      np.broadcast_to(f64(call.temperature), (b, t_all, hq))
  positions = np.arange(t_all) if rows is None else np.asarray(rows)
  if rows is not None:
    temp, dlse = temp[:, rows], dlse[..., rows]
  t = len(positions)
  seg = tuple(None if x is None else np.asarray(x)
              for x in (call.segment_ids, call.kv_segment_ids))
  sinks = None if call.sinks is None else f64(call.sinks)
  per_block = max(1, min(t, TERMS_LOGITS // (b * hq * tk)))
  blocks = -(-t // per_block)
  pad = blocks * per_block - t
  on_t = lambda x, axis, value=0.0: np.pad(
      x, [(0, pad if i == axis else 0) for i in range(x.ndim)], constant_values=value)
  # Padded query rows get lse = +inf: probabilities 0, no terms.
  q, dout, temp = on_t(q, 1), on_t(dout, 1), on_t(temp, 1)
  lse, dlse = on_t(f64(lse), 2, np.inf), on_t(dlse, 2)
  positions = np.pad(positions, (0, pad), mode="edge")
  step, k, v = _block_fn(spec, per_block, rounding, k, v)
  row_parts = collections.defaultdict(list)
  key_sums = {name: np.zeros((b, tk, hq // g, d)) for name in _KEY_TERMS}
  key_sums.update({name: np.zeros((hq,)) for name in _SINK_TERMS})
  pending = {}
  for i in range(blocks):
    sl = slice(i * per_block, (i + 1) * per_block)
    r, key_sums = step(q[:, sl], dout[:, sl], temp[:, sl], lse[..., sl], dlse[..., sl],
                       positions[sl], seg, k, v, sinks, key_sums)
    # The block before this one is brought to the host while the device computes it.
    for name, x in pending.items():
      row_parts[name].append(np.asarray(x))
    pending = r
  for name, x in pending.items():
    row_parts[name].append(np.asarray(x))
  rows_of = lambda name: np.concatenate(row_parts[name], axis=1)[:, :t]
  keys = {name: np.asarray(x) for name, x in key_sums.items()}
  sums = {"out": rows_of("out_sum"), "dq": rows_of("dq_sum"),
          "dk": keys["dk_sum"], "dv": keys["dv_sum"], "dsinks": keys["dsinks_sum"]}
  logit = {"out": rows_of("out_logit"), "dq": rows_of("dq_logit"),
           "lse": np.concatenate(row_parts["lse_logit"], axis=2)[:, :, :t],
           "dk": keys["dk_logit"], "dv": keys["dv_logit"], "dsinks": keys["dsinks_logit"]}
  return sums, logit


_KEY_TERMS = ("dk_sum", "dk_logit", "dv_sum", "dv_logit")
_SINK_TERMS = ("dsinks_sum", "dsinks_logit")  # [Hq], summed over batch rows and queries


def _step(spec, rounding, xp, q_r, dout_r, temp_r, lse_r, dlse_r, pos, seg, k, v, sinks,
          key_sums):
  """One block's row terms, and the key terms summed into ``key_sums`` over
  the block's query rows and each kv head's group of query heads (the sinks'
  over the batch and the rows)."""
  r = _terms(spec, rounding, xp, q_r, dout_r, temp_r, lse_r, dlse_r, pos, seg, k, v, sinks)
  b, t, hq, d = k.shape
  g = spec.group_size
  out = {name: key_sums[name] + r.pop(name).reshape(b, t, hq // g, g, d).sum(axis=3)
         for name in _KEY_TERMS}
  out.update({name: key_sums[name] + r.pop(name) for name in _SINK_TERMS})
  return r, out


def _block_fn(spec, rows: int, rounding: Rounding, k, v):
  """(step, k, v): the terms of ``rows`` query rows against every key, and the
  keys it takes. numpy on a CPU backend (the ci profile's many small
  configurations would each pay an XLA compile of about a second, the cost of
  a case); jitted where the long ones run, on k and v put on the device once,
  the key sums kept there (donated to each block's step), the row blocks
  sliced on the host (an eager slice of a device array is a dispatch: 1280 of
  them took 1.5 s of a T=16k case on the H200)."""
  if jax.default_backend() == "cpu":
    return functools.partial(_step, spec, rounding, np), k, v
  host = host_device()
  if host is not None:  # a TPU: the float64 terms jitted on the host's CPU (numpy: minutes at 4k)
    step = _jitted(spec, rows, rounding)

    def on_host(*args):
      with jax.default_device(host):
        return step(*args)
    return on_host, jax.device_put(k, host), jax.device_put(v, host)
  return _jitted(spec, rows, rounding), jax.device_put(k), jax.device_put(v)


@functools.lru_cache(maxsize=16)
def _jitted(spec, rows: int, rounding: Rounding):
  """One block's step, compiled with the harness's options; ``rows`` is part
  of the key: one compile per block shape."""
  del rows
  return jax.jit(functools.partial(_step, spec, rounding, jnp),
                 donate_argnums=(10,), compiler_options=HARNESS_COMPILER_OPTIONS)  # key_sums


def _bucket(n: int) -> int:
  return max(256, 1 << (n - 1).bit_length())


def host_device():
  """The host's CPU where the accelerator has no native float64 (a TPU: its
  float64 is emulated where it compiles at all), else None: the harness's
  float64 work runs there (runner.harness_device)."""
  return jax.devices("cpu")[0] if jax.default_backend() == "tpu" else None


def _bucketed(fn, x):
  """numpy ``fn(x)`` of an elementwise jnp function, evaluated on x padded to a
  power-of-two length: jax compiles an op per shape, and every case has its own."""
  flat = x.reshape(-1)
  padded = np.pad(flat, (0, _bucket(flat.size) - flat.size))
  return np.asarray(fn(jax.device_put(padded, host_device())))[:flat.size].reshape(x.shape)


def _mask(spec, seg, pos, queries=None, keys=None):
  """visible_keys of the query rows ``pos`` (clamped to the queries: padded
  rows, which have no terms, repeat the last one) for the spec's lengths,
  offset and ``seg`` = (the queries' ids, the keys')."""
  pos = jnp.minimum(jnp.asarray(pos), spec.seq_len - 1)
  return visible_keys(spec.seq_len, seg[0], spec.causal, spec.window_len,
                      queries=pos if queries is None else pos[queries], keys=keys,
                      kv_seq_len=spec.kv_seq_len, kv_segment_ids=seg[1],
                      q_offset=spec.q_offset)


def _bucketed_mask(spec, seg, pos):
  """_mask as numpy, computed at power-of-two position counts (padding
  positions repeat the last one)."""
  tk = spec.kv_seq_len
  queries = np.minimum(np.arange(_bucket(len(pos))), len(pos) - 1)
  keys = np.minimum(np.arange(_bucket(tk)), tk - 1)
  mask = _mask(spec, seg, pos, queries=queries, keys=keys)
  return np.asarray(mask)[:, :len(pos), :tk]


def _derivative_step(xp, spec, grad, s, at, width):
  """How far the cap's derivative ``grad`` (``at``: its value at each logit
  ``s``) moves within ``width`` of ``s`` (the logit's own rounding): 1 where a hard cap's step
  at |s| = c lies that close, so that a logit computed on the other side of it
  (the same-precision reference's too) gets its derivative either way; about
  |c''| * width, a rounding, for a smooth cap; 0 for none. Sampled at both ends
  of the interval and at its point nearest 0, so that an interval wider than
  the cap, around it, still counts the step."""
  if spec.cap_method == "none":
    return 0.0
  nearest_zero = xp.clip(0.0, s - width, s + width)
  return xp.maximum(xp.maximum(xp.abs(grad(s + width) - at), xp.abs(grad(s - width) - at)),
                    xp.abs(grad(nearest_zero) - at))


def _sink_terms(xp, rounding, sinks, lse_r, delta, delta_abs) -> dict:
  """A sink's terms (docs/TOLERANCES.md, "Sinks"): its share of a row,
  p_s = exp(sink - lse), rounded in its exp2 argument like a recomputed logit,
  in the row's lse; d sink_h = -sum_i p_s delta_i over the head's rows, each
  term off by its row correction's error (delta_abs) and p_s's own."""
  if sinks is None:
    zero = xp.zeros(lse_r.shape[1:2])
    return {"lse_logit": 0.0, "dsinks_sum": zero, "dsinks_logit": zero}
  sink = sinks[None, :, None]
  finite = xp.isfinite(lse_r) & xp.isfinite(sink)
  with np.errstate(invalid="ignore", over="ignore"):
    p_s = xp.where(finite, xp.exp(xp.where(finite, sink - lse_r, -np.inf)), 0.0)
  size = xp.where(finite, xp.abs(sink) + xp.abs(lse_r), 0.0)
  row = xp.abs(delta[..., 0]) + delta_abs[..., 0]
  return {"lse_logit": p_s * rounding.recompute * xp.where(finite, xp.abs(sink), 0.0),
          "dsinks_sum": xp.sum(p_s * row, axis=(0, 2)),
          "dsinks_logit": xp.sum(p_s * rounding.recompute * size * row, axis=(0, 2))}


def _pairs(xp, a, b):
  """[B, Hq, rows, T] of a [B, rows, Hq, D] . b [B, T, Hq, D] over D."""
  return xp.matmul(xp.transpose(a, (0, 2, 1, 3)), xp.transpose(b, (0, 2, 3, 1)))


def _rows(xp, w, b):
  """[B, rows, Hq, D] of w [B, Hq, rows, T] times b [B, T, Hq, D] summed over T."""
  return xp.transpose(xp.matmul(w, xp.transpose(b, (0, 2, 1, 3))), (0, 2, 1, 3))


def _keys(xp, w, a):
  """[B, T, Hq, D] of w [B, Hq, rows, T] times a [B, rows, Hq, D] summed over rows."""
  return xp.transpose(xp.matmul(xp.swapaxes(w, -1, -2), xp.transpose(a, (0, 2, 1, 3))),
                      (0, 2, 1, 3))


def _terms(spec, rounding, xp, q_r, dout_r, temp_r, lse_r, dlse_r, pos, seg, k, v, sinks):
  """error_terms' pair sums for one block of query rows, in ``xp`` (numpy, or
  jax.numpy under jit); the cap and the mask are the contract's jnp functions."""
  temp = xp.transpose(temp_r, (0, 2, 1))[..., None]  # [B, Hq, rows, 1]
  scale = abs(spec.sm_scale) * xp.abs(temp)
  s = spec.sm_scale * _pairs(xp, q_r, k)
  cap = lambda fn, x=s: fn(x, *spec.cap_params) if xp is jnp else _bucketed(
      lambda y: fn(y, *spec.cap_params), x)
  z = cap(spec.cap.forward) * temp
  grad = cap(spec.cap.grad)
  slope = scale * xp.abs(grad)  # |s t c'|
  qn, kn = xp.linalg.norm(q_r, axis=-1), xp.linalg.norm(k, axis=-1)  # [B, rows|T, Hq]
  norms = xp.transpose(qn, (0, 2, 1))[..., None] * xp.transpose(kn, (0, 2, 1))[:, :, None]
  width = rounding.logit * (1.0 + abs(spec.sm_scale) * norms) + rounding.recompute * xp.abs(s)
  step = _derivative_step(xp, spec, lambda x: cap(spec.cap.grad, x), s, grad, width)
  mask = _mask(spec, seg, pos) if xp is jnp else _bucketed_mask(spec, seg, pos)
  mask = mask[:, None]
  with np.errstate(invalid="ignore", over="ignore"):
    p = xp.where(mask, xp.exp(xp.where(mask, z - lse_r[..., None], -np.inf)), 0.0)
  a = scale * norms
  # A form's cap value is off by form_eps * the largest parameter, in logit units
  # before the temperature (the softmax scale is inside the cap's argument).
  form = 2.0 * rounding.form * max(spec.cap_params, default=0.0) * xp.abs(temp)
  finite_lse = xp.where(xp.isfinite(lse_r), xp.abs(lse_r), 0.0)[..., None]
  # lse: the logits' float32 dots (Cauchy-Schwarz, as the lse floor was measured
  # to need); the others: a logit recomputed one rounding away, beside lse's.
  pw_lse = p * (rounding.logit * a + form)
  # A probability below the dtype's normal range is rounded absolutely. The
  # recomputed lse's part of p's error is the same factor across a row (pw_row).
  pw_row = p * rounding.recompute * finite_lse
  pw_pair = (p * (rounding.recompute * xp.abs(z) + form)
             + (rounding.subnormal + xp.minimum(p, rounding.flush)) * mask)
  pw = pw_pair + pw_row
  av, ak, aq, ado = (xp.abs(x) for x in (v, k, q_r, dout_r))
  dp, dp_abs = _pairs(xp, dout_r, v), _pairs(xp, ado, av)
  lse_grad = dlse_r + spec.z_loss_weight * xp.where(xp.isfinite(lse_r), lse_r, 0.0)
  # The row correction as a kernel forms it, from its own out (rounded, and off
  # by up to its out's terms): sum_d |dO| (sum_j p |v|), plus the lse cotangent.
  delta_abs = (xp.sum(p * dp_abs, axis=-1)[..., None] + xp.abs(dlse_r)[..., None]
               + abs(spec.z_loss_weight) * finite_lse)
  delta = (xp.sum(p * dp, axis=-1) - lse_grad)[..., None]
  # ds itself (rounded to the input dtype) and its row correction's error; the
  # float32 dot dp, the logits' error carried through p (pw, times ds's own
  # factor: |dp - delta| and the row correction's error) ...
  ds_local = p * xp.abs(dp - delta) * slope
  ds = ds_local + p * delta_abs * slope
  ds_w_row = pw_row * (xp.abs(dp - delta) + delta_abs) * slope
  # ... a cap form's derivative, off by its own error (absolute, not a rounding),
  # and ds below the dtype's normal range.
  ds_w = (pw_pair * (xp.abs(dp - delta) + delta_abs) * slope
          + rounding.logit * p * (dp_abs + delta_abs) * slope
          + p * (xp.abs(dp - delta) + delta_abs) * scale * (rounding.form + step)
          + (rounding.subnormal + rounding.flush) * mask)
  # In dq_i a row's own errors (its correction delta_i, its lse) scale every ds_ij
  # alike: they reach dq_i through sum_j p c' k_j and dq_i, with the signs of k.
  along_rows = lambda x: xp.transpose(x, (0, 2, 1, 3))  # [B, Hq, rows, 1] -> [B, rows, Hq, 1]
  dq_delta = xp.abs(_rows(xp, p * grad, k)) * along_rows(delta_abs * scale)
  dq_lse = xp.abs(_rows(xp, p * (dp - delta) * grad, k)) * along_rows(
      rounding.recompute * finite_lse * scale)
  sink_terms = _sink_terms(xp, rounding, sinks, lse_r, delta, delta_abs)
  return {
      "out_sum": _rows(xp, p, av), "out_logit": _rows(xp, pw, av),
      "lse_logit": xp.sum(pw_lse, axis=-1) + sink_terms.pop("lse_logit"), **sink_terms,
      "dq_sum": _rows(xp, ds_local, ak) + dq_delta,
      "dq_logit": _rows(xp, ds_w, ak) + dq_lse,
      "dk_sum": _keys(xp, ds, aq), "dk_logit": _keys(xp, ds_w + ds_w_row, aq),
      "dv_sum": _keys(xp, p, ado), "dv_logit": _keys(xp, pw, ado),
  }
