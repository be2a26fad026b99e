"""Metamorphic properties of queries and keys of other lengths and of sinks
(docs/SEMANTICS.md): a call against the same implementation's other calls that
must equal it, scored on the drawn (or derived) case's bounds as
properties/checks/checks.py's are. Each has a planted bug that fails it
(tests/test_length_properties.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..judge.runner import Harness, _args, _call, _executable, _extra_kwargs, evaluate
from ..judge.tolerance import compare
from ..model.case import Case
from ..model.inputs import make_inputs
from .checks import _judging, _require

# --------------------------------------------------------------------------- #
# A few queries (decode) equal their rows of the full call.


def rows_inside_the_keys(case: Case) -> bool:
  """Whether the case's queries sit at key positions (0 <= offset and
  offset + Tq <= Tk) and are fewer than the keys: then they are rows of the
  call whose queries are the keys' positions, as a decode step's are of the
  prefill."""
  return case.seq_len < case.tk and 0 <= case.offset and case.offset + case.seq_len <= case.tk


def _full_call(case: Case, inputs: dict) -> tuple[Case, dict]:
  """The call of Tk queries, one per key position, whose rows offset ...
  offset + Tq are the case's (their queries, segment ids, temperatures and
  cotangents); the other rows' queries are the case's first query (any
  values do), their cotangents zero, so that they add nothing to dk, dv and
  d sinks (but a z-loss, which every row's lse carries)."""
  b, tq, tk, o = case.batch, case.seq_len, case.tk, case.offset
  rows = slice(o, o + tq)
  full = {}
  q = np.repeat(inputs["q"][:, :1], tk, axis=1)
  q[:, rows] = inputs["q"]
  full["q"] = q
  for name, axis in (("dout", 1), ("dlse", 2)):
    x = np.zeros(inputs[name].shape[:axis] + (tk,) + inputs[name].shape[axis + 1:],
                 inputs[name].dtype)
    x[(slice(None),) * axis + (rows,)] = inputs[name]
    full[name] = x
  temperature = "none"
  if inputs["temperature"] is not None:
    shape = (b, tq, case.num_q_heads)
    t = np.ones((b, tk, case.num_q_heads), np.float32)
    t[:, rows] = np.broadcast_to(inputs["temperature"], shape)
    full["temperature"], temperature = t, "uniform"
  else:
    full["temperature"] = None
  seg, kv_seg = inputs["segment_ids"], inputs["kv_segment_ids"]
  if seg is not None:  # the keys' ids as they are, the queries' at their rows
    kv_seg = seg if kv_seg is None else kv_seg
    ids = np.array(kv_seg)
    ids[:, rows] = seg
    full["segment_ids"], full["kv_segment_ids"] = ids, kv_seg
  else:
    full["segment_ids"] = full["kv_segment_ids"] = None
  for name in ("k", "v", "sinks"):
    full[name] = inputs[name]
  full_case = dataclasses.replace(case, seq_len=tk, kv_seq_len=None,
                                  q_offset=0 if seg is not None else None,
                                  temperature=temperature)
  return full_case, full


def queries_equal_their_rows_of_the_full_call(impl, case: Case, harness: Harness | None = None):
  """A decode step's (or a chunk's) queries give the rows of the call whose
  queries are every key position (a prefill) at their positions: out, lse and
  dq there, and (without a z-loss, which every row of the full call adds) dk,
  dv and d sinks, the full call's other rows given zero cotangents."""
  harness = _judging(harness, case)
  inputs = make_inputs(case)
  few = evaluate(impl, case, inputs)
  full_case, full_inputs = _full_call(case, inputs)
  full = evaluate(impl, full_case, full_inputs)
  o, tq = case.offset, case.seq_len
  rows = {"out": full["out"][:, o:o + tq], "dq": full["dq"][:, o:o + tq],
          "lse": None if full["lse"] is None else full["lse"][..., o:o + tq]}
  outputs = ("out", "lse", "dq") + (() if case.z_loss_weight else ("dk", "dv", "dsinks"))
  rows.update({name: full.get(name) for name in ("dk", "dv", "dsinks") if name in outputs})
  return _require(harness.score(rows, expected=few, slack=2.0, outputs=outputs),
                  "queries differ from their rows of the full call")


# --------------------------------------------------------------------------- #
# Keys split in two blocks, merged through their lse, equal one call.


def two_key_blocks(case: Case) -> bool:
  return case.tk >= 2


def _block_kwargs(impl, case: Case, tk: int, offset: int) -> dict:
  """One block's keywords: its keys' length and offset, the lse returned, no
  z-loss (the merged lse carries it)."""
  block = dataclasses.replace(case, kv_seq_len=tk, q_offset=offset, z_loss_weight=0.0,
                              return_lse=True)
  return impl.call_kwargs(block)


def _merge(out1, lse1, out2, lse2):
  """(out, lse) of two blocks' (out, lse): each weighted by exp(lse_b - lse);
  a row no block has keys for keeps out 0, lse -inf (and no NaN gradient)."""
  lse = jnp.logaddexp(lse1, lse2)
  finite = jnp.isfinite(lse)
  safe = jnp.where(finite, lse, 0.0)

  def weight(lse_b):
    w = jnp.where(finite & jnp.isfinite(lse_b), jnp.exp(jnp.where(finite, lse_b, 0.0) - safe),
                  0.0)
    return jnp.transpose(w, (0, 2, 1))[..., None]  # [B, Hq, Tq] -> [B, Tq, Hq, 1]

  out = weight(lse1) * out1.astype(jnp.float32) + weight(lse2) * out2.astype(jnp.float32)
  return out.astype(out1.dtype), lse


def _split_fn(impl, case: Case, cut: int):
  """The VJP of the two blocks' merged call: keys [0, cut) with the sinks,
  keys [cut, Tk) without, their offsets the case's less their first key's
  position; a z-loss as the contract adds it, w * lse in lse's cotangent."""
  first = _block_kwargs(impl, case, cut, case.offset)
  second = _block_kwargs(impl, case, case.tk - cut, case.offset - cut)
  w = case.z_loss_weight

  def run(q, k, v, segment_ids, temperature, dout, dlse, kv_segment_ids, sinks):
    kv_ids = kv_segment_ids if kv_segment_ids is not None else segment_ids

    def block(q, k, v, kw, ids, sinks_arg):
      return impl.fn(q, k, v, segment_ids=segment_ids, temperature=temperature,
                     **_extra_kwargs(ids, sinks_arg), **kw)

    def merged(q, k, v, *s):
      ids = (None, None) if kv_ids is None else (kv_ids[:, :cut], kv_ids[:, cut:])
      out1, lse1 = block(q, k[:, :cut], v[:, :cut], first, ids[0], s[0] if s else None)
      out2, lse2 = block(q, k[:, cut:], v[:, cut:], second, ids[1], None)
      return _merge(out1, lse1, out2, lse2)

    primal, vjp = jax.vjp(merged, q, k, v, *(() if sinks is None else (sinks,)))
    out, lse = primal
    cot_lse = (dlse if case.return_lse else jnp.zeros_like(dlse)) + w * jnp.where(
        jnp.isfinite(lse), lse, 0.0)
    grads = vjp((dout, cot_lse.astype(lse.dtype)))
    result = {"out": out, "lse": lse if case.return_lse else None, "dq": grads[0],
              "dk": grads[1], "dv": grads[2]}
    if sinks is not None:
      result["dsinks"] = grads[3]
    return result

  return run


def key_blocks_merge_to_one_call(impl, case: Case, harness: Harness | None = None):
  """Keys split in two blocks, each called with its offset and (the first)
  the sinks, their (out, lse) merged through the lse (split-K's combine, a
  chunked prefill's over its cache), equal one call: outputs and, through
  the merge, every gradient."""
  harness = _judging(harness, case)
  inputs = make_inputs(case)
  cut = case.tk // 2
  args = _args(inputs, float64=False)
  executable = _executable(("key blocks", impl, case.static_key()),
                           lambda: _split_fn(impl, case, cut), args, name="key_blocks_vjp")
  merged = {n: None if x is None else np.asarray(x) for n, x in _call(executable, args).items()}
  one = evaluate(impl, case, inputs)
  # Two calls' roundings and the merge's: three of the case's tolerances.
  return _require(harness.score(merged, expected=one, slack=3.0),
                  "two key blocks merged through their lse differ from one call")


# --------------------------------------------------------------------------- #
# Sinks of -inf are no sinks; a sink is a key of value zero.


def without_sinks(case: Case) -> Case:
  return dataclasses.replace(case, sinks="none")


def minus_inf_sinks_are_no_sinks(impl, case: Case, harness: Harness | None = None):
  """Sinks of -inf on every head equal no sinks (out, lse and the q, k, v
  gradients within two tolerances), and their gradient is exactly zero: a
  sink's share of a row, exp(-inf - lse), is 0, rows without keys included."""
  harness = _judging(harness, without_sinks(case))
  sunk = evaluate(impl, dataclasses.replace(case, sinks="minus_inf"))
  none = evaluate(impl, harness.case)
  errors = harness.score(sunk, expected=none, slack=2.0)
  errors.append(compare("dsinks", sunk["dsinks"], np.zeros_like(sunk["dsinks"]), 0.0, 0.0))
  return _require(errors, "sinks of -inf differ from no sinks")


def with_sink_channel(case: Case) -> Case:
  """The case on inputs whose last channel carries the sinks as a key's
  logit (inputs._sink_channel)."""
  return dataclasses.replace(case, distribution="sink_channel")


def finite_sinks_before_every_query(case: Case) -> bool:
  """Sinks a key's logit can carry (finite), and a key at position 0 that
  every query sees: no causal bound before it (offset >= -1)."""
  return case.sinks in ("normal", "large") and (not case.causal or case.offset >= -1)


def sink_is_an_extra_key(impl, case: Case, harness: Harness | None = None):
  """A sink equals a key of value zero whose logit is that sink: the key
  (0, ..., 0, 1) put before the others, where every query sees it, against
  queries whose last channel is sink / sm_scale and keys whose last channel
  is 0 (with_sink_channel). out, lse, dk and dv equal; dq equal on the other
  channels (the sinked call's last is 0: no key has that channel); d sinks
  equals the extra key's ds summed over rows, the last channel of its dq over
  sm_scale."""
  case = with_sink_channel(case)
  harness = _judging(harness, case)
  inputs = make_inputs(case)
  sunk = evaluate(impl, case, inputs)
  keyed_case, keyed_inputs = _extra_key(case, inputs)
  keyed = evaluate(impl, keyed_case, keyed_inputs)
  sm = case.sm_scale if case.sm_scale is not None else 1.0 / np.sqrt(case.head_dim)
  dq = np.array(keyed["dq"], np.float64)
  dsinks = dq[..., -1].sum(axis=(0, 1)) / sm
  dq[..., -1] = 0.0
  mapped = {"out": keyed["out"], "lse": keyed["lse"], "dq": dq.astype(keyed["dq"].dtype),
            "dk": keyed["dk"][:, 1:], "dv": keyed["dv"][:, 1:], "dsinks": dsinks}
  return _require(harness.score(mapped, expected=sunk, slack=2.0),
                  "a sink differs from a key of value zero with that logit")


def _extra_key(case: Case, inputs: dict) -> tuple[Case, dict]:
  """The case's call without sinks, with one more key first: (0, ..., 0, 1)
  and value 0; the queries' offset one more, so the other keys keep their
  places relative to them."""
  b, hkv, d = case.batch, case.num_kv_heads, case.head_dim
  key = np.zeros((b, 1, hkv, d), inputs["k"].dtype)
  key[..., -1] = 1
  keyed = dict(inputs, sinks=None, k=np.concatenate([key, inputs["k"]], axis=1),
               v=np.concatenate([np.zeros_like(key), inputs["v"]], axis=1))
  tk = case.tk + 1
  keyed_case = dataclasses.replace(case, kv_seq_len=None if tk == case.seq_len else tk,
                                   sinks="none",
                                   q_offset=None if case.q_offset is None else case.offset + 1)
  return keyed_case, keyed
