"""Where a float32 dk error comes from, on the CPU (docs/DEFECTS.md, D32).

    python -m benchmarks.dk_summation_order CASE.json [--cut 20] [--json OUT]

For a saved case (one batch row and one head, no cap, temperature or segment
ids) recomputes dk in float64 from the exact scores, then three ways that each
change one thing, and prints each one's max |dk - exact dk|:

- ``scores``: the scores as the GPU's float32 Triton dot forms them (one fused
  multiply-add per head-dim element, in order), everything else exact;
- ``rows``: exact probabilities, dk summed over the query rows in float32 with
  one rounding per product, rows in order (a dot accumulating into the running
  dk, which is what Triton's combine pass makes of ``dk + dot(ds, q)``);
- ``tiles``: the same, each 64-row tile's product summed in float32 from zero
  and rounded once into the running dk (tile_math.gradient_product);
- ``lse2``: the scores as in ``scores``, their base-2 logits rounded to
  float32 (as the kernels form them), and the probabilities recomputed from
  the row's lse2 rounded to float32, as a backward reads it that has one
  float32 row statistic without SoftmaxState.finalize's low part; everything
  else exact.

Keys more than ``--cut`` below a row's largest logit are dropped (probability
below e^-cut): for the saved T=16384 case cuts of 20 and 25 agree to eight digits
at T=2048.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from properties.model.case import load_case_file
from properties.model.inputs import make_inputs

TILE = 64


def float32_fma_scores(q_cols, k_cols):
  """q.k of the pairs (columns of [D, n] float32 arrays), one float32 fused
  multiply-add per element in order (the product is exact in float64)."""
  acc = np.zeros(q_cols.shape[1], np.float32)
  for d in range(q_cols.shape[0]):
    acc = (q_cols[d].astype(np.float64) * k_cols[d] + acc).astype(np.float32)
  return acc


def dk_four_ways(case, x, cut: float) -> dict:
  """dk of the case's one row and head: exact (float64), and each of the
  module docstring's ways (``scores``, ``rows``, ``tiles``, ``lse2``)."""
  q, k, v, dout = (x[name][0, :, 0, :] for name in ("q", "k", "v", "dout"))
  dlse = x["dlse"][0, 0].astype(np.float64)
  t, d = q.shape
  sm = case.sm_scale if case.sm_scale is not None else d ** -0.5
  w = case.z_loss_weight
  q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, dout))
  q_cols, k_cols = np.ascontiguousarray(q.T), np.ascontiguousarray(k.T)
  scale2 = np.float32(sm * np.log2(np.e))  # the kernels' logits are base 2

  dk = {"exact": np.zeros((t, d)), "scores": np.zeros((t, d)), "lse2": np.zeros((t, d)),
        "rows": np.zeros((t, d), np.float32), "tiles": np.zeros((t, d), np.float32)}
  start = time.time()
  for r0 in range(0, t, 512):
    r1 = min(t, r0 + 512)
    keys = r1 if case.causal else t  # causal rows see no key past r1
    z = sm * (q64[r0:r1] @ k64[:keys].T)
    if case.causal:
      z = np.where(np.arange(keys)[None, :] <= np.arange(r0, r1)[:, None], z, -np.inf)
    ii, jj = np.nonzero(z >= z.max(axis=1, keepdims=True) - cut)  # row-major: rows in order
    chunk = 1 << 20
    gpu_scores = np.concatenate([
        float32_fma_scores(q_cols[:, r0 + ii[c:c + chunk]], k_cols[:, jj[c:c + chunk]])
        for c in range(0, len(ii), chunk)])
    z_gpu = (gpu_scores * scale2).astype(np.float64) / np.log2(np.e)
    for name, zz in (("exact", z[ii, jj]), ("scores", z_gpu), ("lse2", z_gpu)):
      m = np.full(r1 - r0, -np.inf)
      np.maximum.at(m, ii, zz)
      total = np.zeros(r1 - r0)
      np.add.at(total, ii, np.exp(zz - m[ii]))
      lse = m + np.log(total)
      if name == "lse2":  # rounded to float32 in base 2, as the forward stores it
        lse = (lse * np.log2(np.e)).astype(np.float32).astype(np.float64) / np.log2(np.e)
      p = np.exp(zz - lse[ii])
      out = np.zeros((r1 - r0, d))
      np.add.at(out, ii, p[:, None] * v64[jj])
      delta = np.sum(do64[r0:r1] * out, axis=1) - dlse[r0:r1] - w * lse
      ds = p * (np.sum(do64[r0 + ii] * v64[jj], axis=1) - delta[ii])
      terms = (sm * ds)[:, None] * q64[r0 + ii]
      np.add.at(dk[name], jj, terms)
      if name == "exact":
        np.add.at(dk["rows"], jj, terms.astype(np.float32))  # in order, one rounding per add
        for t0 in range(r0, r1, TILE):
          sel = (r0 + ii >= t0) & (r0 + ii < t0 + TILE)
          tile = np.zeros((keys, d), np.float32)
          np.add.at(tile, jj[sel], terms[sel].astype(np.float32))
          seen = np.unique(jj[sel])
          dk["tiles"][seen] = dk["tiles"][seen] + tile[seen]
    print(f"rows {r1}/{t} ({time.time() - start:.0f} s)", flush=True)
  return dk


def _errors(dk: dict, saved_dk) -> dict:
  """Each way's max |dk - exact dk| and where, printed as it goes."""
  errors = {}
  for name in ("scores", "rows", "tiles", "lse2"):
    err = np.abs(dk[name].astype(np.float64) - dk["exact"])
    where = np.unravel_index(np.argmax(err), err.shape)
    errors[name] = {"max_abs_err": float(err.max()), "worst_index": [int(i) for i in where]}
    line = f"{name:7} max |dk error| {err.max():.4g} at key {where[0]}, dim {where[1]}"
    if saved_dk:
      key, dim = saved_dk["worst_index"][1], saved_dk["worst_index"][3]
      errors[name]["at_saved_worst_index"] = float(err[key, dim])
      line += (f"; {err[key, dim]:.4g} at the saved run's worst (key {key}, dim {dim}: "
               f"{saved_dk['max_abs_err']:.4g} there, tolerance {saved_dk['tolerance']:.4g})")
    print(line)
  return errors


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.dk_summation_order",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("case")
  parser.add_argument("--cut", type=float, default=20.0)
  parser.add_argument("--json")
  options = parser.parse_args(argv)
  saved = load_case_file(options.case)
  case = saved["case"]
  # Where the saved run found dk's worst error ([batch, key, head, dim]), if it did.
  saved_dk = next((e for e in saved.get("errors", []) if e.get("name") == "dk"), None)
  if (case.batch, case.num_q_heads, case.num_kv_heads) != (1, 1, 1) or case.cap_method != "none" \
      or case.temperature != "none" or case.segments != "none" or case.window_len:
    parser.error("the case must have one batch row, one head, and no cap, temperature, "
                 "segment ids or window")
  inputs = make_inputs(case)
  start = time.time()
  dk = dk_four_ways(case, inputs, options.cut)
  result = {"case": options.case, "cut": options.cut,
            "max_abs_dk": float(np.abs(dk["exact"]).max()), "errors": _errors(dk, saved_dk),
            "saved_dk": saved_dk, "seconds": round(time.time() - start)}
  if options.json:
    with open(options.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
