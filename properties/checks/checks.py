"""The properties. Each takes (impl, case) and returns the comparisons it
made, raising PropertyFailure when one is out of tolerance. One that scores
against the oracle also takes ``harness``, the Harness of the case it judges
(the drawn case, or the one its registry entry's ``judged`` derives), built
once by the verifier; called without it, it builds its own.
properties/checks/registry.py says which cases each applies to;
properties/run/verifier.py runs them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..judge import error_terms
from ..judge.bias import (CASE_BIAS_FLOOR_ULPS, JUDGED_DTYPES, BiasStats, output_dtype, stats,
                          verdicts)
from ..model.capabilities import Implementation, load_impl
from ..model.case import Case
from ..model.inputs import logit_scale, make_inputs
from ..judge.runner import (Harness, HarnessError, evaluate, evaluate_arrays,
                            evaluate_with_plain_call, x64)
from ..judge.tolerance import FLOOR, OutputError, compare, error_table


class PropertyFailure(AssertionError):
  """A property's verdict against a case. ``biased`` names the outputs that
  failed the bias verdict alone (every comparison within its bound)."""

  def __init__(self, message: str, errors: list[OutputError] = (), biased=()):
    self.errors = list(errors)
    self.biased = tuple(biased)
    table = error_table(self.errors) if self.errors else ""
    super().__init__(message + ("\n" + table if table else ""))


def _require(errors: list[OutputError], what: str):
  bad = [e for e in errors if not e.ok]
  if bad:
    raise PropertyFailure(f"{what}: {', '.join(e.name for e in bad)} out of tolerance", errors)
  return errors


def _replace(case: Case, **changes) -> Case:
  return dataclasses.replace(case, **changes)


def _judging(harness: Harness | None, case: Case) -> Harness:
  """``harness`` if it judges ``case`` (the verifier's), else ``case``'s own,
  built here: a check called alone builds what the verifier would have."""
  if harness is None:
    return Harness.of(case)
  if harness.case != case:
    raise ValueError(f"the harness given judges {harness.case}, not {case}: the property's "
                     f"registry entry (judged) and its check disagree")
  return harness


# --------------------------------------------------------------------------- #
# Equivalence with the float64 oracle.

def matches_oracle(impl, case: Case, harness: Harness | None = None):
  """Outputs and gradients (through jax.vjp), and the outputs of a plain call,
  within tolerance of the float64 oracle, and (bias.py) without a systematic
  shift of their rounding."""
  harness = _judging(harness, case)
  result, plain_result = evaluate_with_plain_call(impl, case)
  errors = harness.score(result)
  rows = harness.judged(result)
  judged = {}
  for e in errors:
    if e.name not in harness.oracle:  # sampled rows' "dq (other rows)": exact zeros
      continue
    dtype = output_dtype(e.name, case.dtype)
    e.bias = stats(rows[e.name], harness.oracle[e.name], dtype,
                   harness.reference[e.name]).to_dict()
    if dtype in JUDGED_DTYPES:
      judged[e.name] = BiasStats(**e.bias)
  plain = harness.score(plain_result, outputs=("out", "lse"))
  for e in plain:
    e.name = f"{e.name} (plain call)"
  _require(errors + plain, "implementation differs from the float64 oracle")
  biased = {name: v for name, v in verdicts(judged, floor=CASE_BIAS_FLOOR_ULPS).items()
            if v["biased"]}
  if biased:
    raise PropertyFailure("a systematic shift of the rounding (bias.py): " + "; ".join(
        f"{name}: mean {v['mean_ulps']:+.3f} ulp, {v['below']} toward zero and {v['above']} "
        f"away of {v['n']} elements, rows {v['rows_below']} toward and {v['rows_above']} away, "
        f"Holm p = {v['p_holm']:.2e}" for name, v in biased.items()),
        errors + plain, biased=tuple(biased))
  return errors + plain


def matches_oracle_under_x64(impl, case: Case, harness: Harness | None = None):
  """The same equivalence with jax_enable_x64 on (16/32-bit inputs): an
  implementation must not change what it computes when a caller enables x64."""
  with x64(True):
    return matches_oracle(impl, case, harness)


# --------------------------------------------------------------------------- #
# Metamorphic properties: need no oracle for their truth; the oracle's
# same-precision reference only sizes the rounding allowance.

def key_permutation_invariance(impl, case: Case, harness: Harness | None = None):
  """Permuting keys and values jointly (no causal, no window) changes nothing."""
  inputs = make_inputs(case)
  perm = np.random.default_rng(case.seed + 1).permutation(case.tk)
  permuted = dict(inputs)
  for name in ("k", "v"):
    permuted[name] = inputs[name][:, perm]
  if inputs["segment_ids"] is not None:
    # Keys carry their segment id with them; queries keep theirs.
    raise ValueError("permutation property is drawn without segment ids")
  base = evaluate(impl, case, inputs)
  moved = evaluate(impl, case, permuted)
  inverse = np.argsort(perm)
  for name in ("dk", "dv"):
    moved[name] = moved[name][:, inverse]
  return _require(_judging(harness, case).score(moved, expected=base, slack=2.0),
                  "permuting keys and values changed the result")


def packed_equals_separate(impl, case: Case, harness: Harness | None = None):
  """A packed batch row equals each of its documents run alone. An
  implementation that takes only some lengths (ua_seq_len_multiple) runs a
  document alone padded to the next one, the padding a document of its own."""
  bounds = _judging(harness, case).bounds
  inputs = make_inputs(case)
  packed = evaluate(impl, case, inputs)
  seg = inputs["segment_ids"]
  errors = []
  for b in range(case.batch):
    starts = np.flatnonzero(np.diff(seg[b], prepend=seg[b][0] - 1))
    for start, stop in list(zip(starts, list(starts[1:]) + [case.seq_len]))[:3]:
      length = int(stop - start)
      sub_case, sub = _document_alone(impl, case, inputs, b, start, length)
      alone = evaluate(impl, sub_case, sub)
      for name in ("out", "lse", "dq", "dk", "dv"):
        if packed[name] is None:
          continue
        take = (lambda x: x[b:b + 1, :, start:stop]) if name == "lse" else \
               (lambda x: x[b:b + 1, start:stop])
        own = alone[name][:, :, :length] if name == "lse" else alone[name][:, :length]
        ref_err, tol = bounds[name]
        errors.append(compare(name, take(packed[name]), own, ref_err, take(tol),
                              slack=2.0, label=f"{name}[b{b},{start}:{stop}]"))
  bad = [e for e in errors if not e.ok]
  if bad:
    raise PropertyFailure("a packed document differs from the same document alone", bad)
  return errors


def _document_alone(impl, case: Case, inputs: dict, b: int, start: int, length: int):
  """(case, inputs) of batch row ``b``'s document [start, start + length)
  alone: no segment ids, or, padded to a length ``impl`` takes, ids 0 for
  the document and 1 for the padding (zeros, unit temperature)."""
  t = impl.fit_seq_len(length)
  pad = lambda x, axis, value=0.0: np.pad(
      x, [(0, t - length) if a == axis else (0, 0) for a in range(x.ndim)],
      constant_values=value)
  sub = {"segment_ids": None if t == length else
         np.asarray([[0] * length + [1] * (t - length)], np.int32)}
  for name, x in inputs.items():
    if x is None or name == "segment_ids":
      sub.setdefault(name, None)
    elif name == "dlse":
      sub[name] = pad(x[b:b + 1, :, start:start + length], 2)
    elif name == "temperature":
      full = np.broadcast_to(x, (case.batch, case.seq_len, case.num_q_heads))
      sub[name] = pad(np.ascontiguousarray(full[b:b + 1, start:start + length]), 1, 1.0)
    else:
      sub[name] = pad(x[b:b + 1, start:start + length], 1)
  segments = "none" if t == length else "packed"
  return _replace(case, batch=1, seq_len=t, segments=segments), sub


def hidden_key_sets(case: Case, segment_ids=None):
  """(rows, poison): [B, T] bool masks of queries and of keys none of those
  queries can see, or None when the case hides no key from any query.

  With segments, the last document's keys (hidden from the other documents);
  else with causal, the last quarter of keys (hidden from earlier queries);
  else with a window shorter than T, the first keys (hidden from queries
  beyond the window).
  """
  t = case.seq_len
  rows = np.zeros((case.batch, t), bool)
  poison = np.zeros((case.batch, t), bool)
  if case.segments != "none":
    seg = make_inputs(case)["segment_ids"] if segment_ids is None else segment_ids
    poison = seg == seg[:, -1:]
    rows = ~poison
  elif case.causal:
    cut = t - max(1, t // 4)
    poison[:, cut:] = True
    rows[:, :cut] = True
  elif 0 < case.window_len < t:
    # Keys [0, c) are hidden from queries i >= c - 1 + window_len.
    c = max(1, (t - case.window_len) // 2)
    poison[:, :c] = True
    rows[:, c - 1 + case.window_len:] = True
  return (rows, poison) if rows.any() else None


def hidden_keys_do_not_leak(impl, case: Case):
  """Poisoning keys/values hidden from a set of queries leaves those rows alone.

  Poison: huge finite keys and values (1e4 in 16-bit, 1e30 in float32 values),
  on the keys of hidden_key_sets.
  """
  inputs = make_inputs(case)
  sets = hidden_key_sets(case, inputs["segment_ids"])
  if sets is None:
    raise ValueError("hidden_keys_do_not_leak needs a case that hides some key "
                     "(registry: applies)")
  rows, poison = sets
  huge_v = 1e30 if case.dtype == "float32" else 1e4
  bad_inputs = dict(inputs)
  for name, value in (("k", 1e4 if case.dtype != "float32" else 1e6), ("v", huge_v)):
    x = inputs[name].copy()
    x[poison] = np.asarray(value, x.dtype) * np.where(
        np.random.default_rng(case.seed).random(x[poison].shape) < 0.5, -1, 1).astype(x.dtype)
    bad_inputs[name] = x
  clean = evaluate_arrays(impl, case, inputs)
  dirty = evaluate_arrays(impl, case, bad_inputs)
  errors = []
  for name in ("out", "dq", "lse"):
    if clean[name] is None:
      continue
    mask = rows if name != "lse" else rows[:, None, :]
    errors.append(_rows_unchanged(name, mask, dirty[name], clean[name]))
  bad = [e for e in errors if not e.ok]
  if bad:
    raise PropertyFailure("poisoned hidden keys changed rows that cannot see them", bad)
  return errors


def _rows_unchanged(name: str, mask, dirty, clean) -> OutputError:
  """compare(dirty, clean) at tolerance 0 on the rows of ``mask``, decided on
  the device that computed them: at T = 16k bringing the outputs to the host
  and comparing them there took seconds per output, the implementation's runs
  milliseconds. Only a difference is brought over, for compare's report."""
  mask = jax.device_put(mask.reshape(mask.shape + (1,) * (dirty.ndim - mask.ndim)))
  if bool(_same_on(mask, dirty, clean)):
    return OutputError(name, 0.0, 0.0, 0.0, 0, 0, (0,) * dirty.ndim, error=0.0)
  mask = np.broadcast_to(np.asarray(mask), dirty.shape)
  sel = lambda x: np.where(mask, np.asarray(x), 0)
  return compare(name, sel(dirty), sel(clean), 0.0, 0.0)


@jax.jit
def _same_on(mask, dirty, clean):
  """dirty == clean (and not NaN) wherever mask holds: one compile per shape, not one per
  operation."""
  return jnp.all(~mask | ((dirty == clean) & ~jnp.isnan(dirty)))


def _same_call(impl: Implementation, harness: Harness, other: Case, what: str,
               slack: float = 2.0):
  """``other`` evaluated equals the harness's case evaluated, on its bounds."""
  return _require(harness.score(evaluate(impl, other), expected=evaluate(impl, harness.case),
                                slack=slack), what)


# The cases the properties below judge, derived from the drawn one: their registry
# entries name them (Property.judged), so the verifier builds those cases' harnesses.
without_z_loss = functools.partial(_replace, z_loss_weight=0.0)
without_temperature = functools.partial(_replace, temperature="none")
without_cap = functools.partial(_replace, cap_method="none", cap_params=())
without_window = functools.partial(_replace, window_len=0)


def zero_z_loss_is_no_z_loss(impl, case: Case, harness: Harness | None = None):
  """An explicit z_loss_weight=0.0 is bit-identical to not passing it."""
  case = without_z_loss(case)
  harness = _judging(harness, case)
  explicit = evaluate(impl, case)
  omitted = evaluate(impl, case, omit=("z_loss_weight",))
  return _require(harness.score(omitted, expected=explicit, slack=0.0),
                  "z_loss_weight=0 differs from no z-loss")


def unit_temperature_is_none(impl, case: Case, harness: Harness | None = None):
  """A temperature of ones equals no temperature."""
  return _same_call(impl, _judging(harness, without_temperature(case)),
                    _replace(case, temperature="ones"),
                    "temperature of ones differs from temperature=None")


def huge_tanh_cap_is_no_cap(impl, case: Case, harness: Harness | None = None):
  """A huge tanh cap equals no cap, up to the cap's own effect: c tanh(x / c) is
  within |x|^3 / (3 c^2) of x. The cap is 10^4 times the logits' scale (what
  caught the bfloat16 fast tanh, B16), raised where that effect, at the
  Cauchy-Schwarz bound of |t x|, would pass FLOOR[dtype] / 16 of a logit:
  saturating float32 logits near 600 moved dq and dk by 1.6 times their floors
  at 10^4 (docs/TOLERANCES.md, "Tighter floors"). lse, a float32 output, is
  allowed the remaining shift."""
  x, t = _largest_logit(case)
  cap = max(1e4 * logit_scale(case), math.sqrt(16.0 * t * x ** 3 / (3.0 * FLOOR[case.dtype])))
  harness = _judging(harness, without_cap(case))
  capped = _replace(case, cap_method="tanh", cap_params=(cap,))
  expected, result = evaluate(impl, harness.case), evaluate(impl, capped)
  errors = harness.score(result, expected=expected, slack=2.0)
  if result.get("lse") is not None and expected.get("lse") is not None:
    ref_err, tol = harness.bounds["lse"]
    shift = t * x ** 3 / (3.0 * cap ** 2)
    lse, expected_lse = harness.judged(result)["lse"], harness.judged(expected)["lse"]
    errors = [compare("lse", lse, expected_lse, ref_err, 2.0 * tol + shift)
              if e.name == "lse" else e for e in errors]
  return _require(errors, "a huge tanh cap differs from no cap")


def _largest_logit(case: Case) -> tuple[float, float]:
  """Bounds on |s q.k| over the case's pairs (Cauchy-Schwarz) and on |t|, float64."""
  inputs = make_inputs(case)
  call = error_terms.spec_of(case, inputs)  # the contract's defaults
  spec, temp = call.spec, call.temperature
  norm = lambda x: float(np.max(np.linalg.norm(np.asarray(x, np.float64), axis=-1), initial=0.0))
  t = 1.0 if temp is None else float(np.max(np.abs(np.asarray(temp, np.float64)), initial=0.0))
  return abs(spec.sm_scale) * norm(inputs["q"]) * norm(inputs["k"]), t


def window_covering_sequence_is_no_window(impl, case: Case, harness: Harness | None = None):
  """A window reaching every key (at least Tq + offset: the last query's
  position plus one) equals no window."""
  return _same_call(impl, _judging(harness, without_window(case)),
                    _replace(case, window_len=max(1, case.seq_len + case.offset) + case.seed % 5),
                    "a window reaching every key differs from no window")


def gqa_equals_repeated_heads(impl, case: Case, harness: Harness | None = None):
  """GQA equals MHA on K/V heads repeated G times; dk/dv are the group sums."""
  g = case.num_q_heads // case.num_kv_heads
  inputs = make_inputs(case)
  repeated = dict(inputs)
  for name in ("k", "v"):
    repeated[name] = np.repeat(inputs[name], g, axis=2)
  mha_case = _replace(case, num_kv_heads=case.num_q_heads)
  mha = evaluate(impl, mha_case, repeated)
  for name in ("dk", "dv"):
    x = mha[name].astype(np.float64)
    mha[name] = x.reshape(x.shape[:2] + (case.num_kv_heads, g) + x.shape[3:]).sum(axis=3)
  gqa = evaluate(impl, case, inputs)
  # Group sums add up to G rounded terms: allow G + 1 tolerances for dk/dv.
  harness = _judging(harness, case)
  errors = harness.score(mha, expected=gqa, slack=2.0, outputs=("out", "lse", "dq", "dsinks"))
  errors += harness.score(mha, expected=gqa, slack=g + 1.0, outputs=("dk", "dv"))
  return _require(errors, "GQA differs from MHA with repeated kv heads")


# --------------------------------------------------------------------------- #
# A sharded op against the same op on one device.

def sharded_equals_unsharded(impl, case: Case, harness: Harness | None = None):
  """A sharded op (one that declares ``ua_unsharded``) equals its single-device
  counterpart on the same inputs, outputs and gradients, within two of the
  case's tolerances, as the other metamorphic properties: a failure then points
  at the sharding (layout, ring, merge), where matches_oracle's would not say."""
  if impl.unsharded is None:
    raise ValueError(f"{impl.name} declares no ua_unsharded: sharded_equals_unsharded has "
                     "nothing to compare it with")
  inputs = make_inputs(case)
  sharded = evaluate(impl, case, inputs)
  # The counterpart's own trouble (it does not load, takes no such case, runs out
  # of memory where only the sharded op fits) leaves the case unjudged.
  try:
    single = _unsharded(impl.unsharded)
    why = single.supports(case)
    if why is not None:
      raise ValueError(f"it {why}")
    expected = evaluate(single, case, inputs)
  except Exception as exc:  # noqa: BLE001 -- re-raised as the harness's
    raise HarnessError(f"the single-device counterpart {impl.unsharded} could not evaluate "
                       f"the case: {type(exc).__name__}: {exc}") from exc
  return _require(_judging(harness, case).score(sharded, expected=expected, slack=2.0),
                  f"{impl.name} differs from {single.name}")


@functools.lru_cache(maxsize=None)
def _unsharded(spec: str) -> Implementation:
  """One Implementation per counterpart, so its compiled calls are reused."""
  return load_impl(spec)
