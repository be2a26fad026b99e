"""python -m benchmarks.mutation (ua-mutate): source-level mutation testing of ua_kernels, from a source checkout.

Each mutant is one textual change to the kernels or their wrapper. For each,
the checkout (``--repo``, default the current directory) is copied to a
temporary directory, the change applied, and the black-box suite (the
regression corpus, then the properties, ci profile, interpret mode) run there
until the first failure: killed (with the test that killed it and the time to
kill) or survived. Mutants O1-O9 re-introduce the original kernel's defects
(docs/DEFECTS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path



@dataclasses.dataclass(frozen=True)
class Mutant:
  id: str
  file: str
  old: str
  new: str
  description: str
  occurrence: int | None = None  # which match to change when not unique (0-based)
  # In CI's rotation (--rotate). A mutant that only a campaign verdict can kill
  # (S3: every case passes, the errors grow) runs the whole suite before it
  # dies, tens of minutes here: run it with --only.
  rotates: bool = True


TILE_MATH, KERNELS, LAUNCH, ATTENTION, SOFTMAX_STATE, SEGMENT_SPANS, CAP_FORMS = (
    "ua_kernels/tile_math.py", "ua_kernels/triton/kernels.py", "ua_kernels/triton/launch.py",
    "ua_kernels/attention.py", "ua_kernels/softmax_state.py", "ua_kernels/segment_spans.py",
    "ua_kernels/cap_forms.py")

MUTANTS = [
    # --- the original kernel's defects, re-introduced ---------------------------------------
    Mutant("O1", TILE_MATH,
           "    scores = cap_forward(cap_arg, *params)\n",
           "    if mask is not None:\n      cap_arg = jnp.where(mask, cap_arg, -jnp.inf)\n"
           "      mask = None\n"
           "    scores = cap_forward(cap_arg, *params)\n",
           "original kernel: mask applied before the cap (cap(-inf) is finite for tanh/hard)"),
    Mutant("O2", TILE_MATH, "hi = jnp.minimum(_ceil_div(q_start + block_q, block_kv), hi)",
           "hi = jnp.minimum(_div(q_start, block_kv) + 1, hi)",
           "original kernel: causal key-loop bound floor(q_start/bkv)+1 (misses keys when bq > bkv)"),
    Mutant("O3", TILE_MATH, "lo = _div(jnp.maximum(q_start - (spec.window_len - 1), 0), block_kv)",
           "lo = jnp.maximum(hi - (spec.window_len + block_q) // block_kv, 0)",
           "original kernel: window lower bound counted back from the upper bound (off by one; "
           "wrong without causal)"),
    Mutant("O4", TILE_MATH,
           "  return exp2_shifted(logits, jnp.where(shift == -jnp.inf, jnp.inf, shift), low)",
           "  p = exp2_shifted(logits, jnp.where(shift == -jnp.inf, jnp.inf, shift), low)\n"
           "  return p / jnp.maximum(jnp.sum(p, axis=1, keepdims=True), 1e-30)",
           "original kernel: backward probabilities renormalised within each key block"),
    Mutant("O5", ATTENTION, "- dlse - spec.z_loss_weight * lse\n",
           "- dlse - spec.z_loss_weight * lse * jnp.exp(-jnp.abs(lse))\n",
           "original kernel: z-loss gradient divided by the softmax normaliser"),
    Mutant("O6", KERNELS, "ds = logits_grad(spec, p, dp, delta, logits, qt.temp, fast_cap)",
           "ds = logits_grad(spec, p, dp, delta, logits._replace(cap_arg=logits.scores), "
           "qt.temp, fast_cap)",
           "original kernel: cap gradient evaluated on capped, temperature-scaled logits (dq)"),
    Mutant("O7", TILE_MATH,
           "hi = jnp.minimum(_ceil_div(k_start + block_kv - 1 + spec.window_len, block_q), hi)",
           "hi = jnp.minimum(lo + (spec.window_len + block_kv) // block_q, hi)",
           "original kernel: dk/dv query-loop window bound counted from the loop start"),
    Mutant("O8", KERNELS, "      return lax.fori_loop(0, spec.group_size, lambda g, carry: add_head_tile(",
           "      return lax.fori_loop(0, 1, lambda g, carry: add_head_tile(",
           "original kernel: dk/dv not summed over the GQA group (first query head only; "
           "16-bit)"),
    Mutant("G2", KERNELS, "      return total[0] + dk, total[1] + dv",
           "      return dk, dv",
           "float32 per-head totals not added up (dk/dv of the last query head only)"),
    Mutant("O9", KERNELS, "k = k_ref[pl.ds(k_start, block_kv), :]",
           "k = k_ref[:, pl.ds(k_start, block_kv)]",
           "original kernel: K tile sliced along the head dim instead of the sequence (forward, dq)"),
    # --- plausible kernel bugs ----------------------------------------------
    Mutant("M1", TILE_MATH, "conditions.append(k_pos <= q_pos)",
           "conditions.append(k_pos < q_pos)", "causal diagonal hidden"),
    Mutant("M2", TILE_MATH, "conditions.append(k_pos > q_pos - spec.window_len)",
           "conditions.append(k_pos >= q_pos - spec.window_len)",
           "window edge off by one"),
    Mutant("M3", TILE_MATH,
           "conditions.append(_tile_grid(q_seg, shape, query_axis) == _tile_grid(k_seg, shape, key_axis))",
           "conditions.append(_tile_grid(q_seg, shape, query_axis) >= _tile_grid(k_seg, shape, key_axis))",
           "segment edge: earlier documents visible"),
    Mutant("M4", TILE_MATH, "(q_pos < spec.seq_len) & (k_pos < spec.kv_seq_len)",
           "(q_pos < spec.seq_len)", "tail keys (padding) not masked"),
    Mutant("M5", TILE_MATH, "num_blocks = -(-spec.kv_seq_len // block_kv)",
           "num_blocks = spec.kv_seq_len // block_kv", "tail key block dropped (floor)"),
    Mutant("M6", TILE_MATH, "num_blocks = -(-spec.seq_len // block_q)",
           "num_blocks = max(spec.seq_len // block_q, 1)", "tail query block dropped in dk/dv"),
    Mutant("M7", TILE_MATH, "  if spec.cap_method == \"none\":\n    scores, cap_arg",
           "  if temp is not None and spec.cap_method != 'none':\n"
           "    qk = qk * along_rows(temp, qk)\n    temp = None\n"
           "  if spec.cap_method == \"none\":\n    scores, cap_arg",
           "temperature applied before the cap"),
    Mutant("M8", TILE_MATH,
           "  if temp is not None:\n    ds = ds * along_queries(temp, ds, logits.query_axis)\n", "",
           "temperature missing from the logits gradient"),
    Mutant("M9", TILE_MATH, "    ds = ds * cap_grad(logits.cap_arg, *logits.cap_params)\n",
           "    ds = ds * 1.0\n", "cap gradient dropped (taken as 1)"),
    Mutant("M10", ATTENTION, "- dlse - spec.z_loss_weight * lse\n", "- dlse + spec.z_loss_weight * lse\n",
           "z-loss gradient sign flipped"),
    Mutant("M11", ATTENTION, "- dlse - spec.z_loss_weight * lse\n", "- spec.z_loss_weight * lse\n",
           "lse cotangent ignored"),
    Mutant("M12", TILE_MATH, "  return ds * spec.sm_scale", "  return ds", "sm_scale missing from gradients"),
    Mutant("M13", SOFTMAX_STATE, "dot(p.astype(v.dtype), v)",
           "dot(p.astype(jnp.bfloat16), v.astype(jnp.bfloat16))",
           "forward P@V in bfloat16 whatever the input precision"),
    Mutant("M14", KERNELS, "term = gradient_product(ds16, q, trans_a=True)",
           "term = gradient_product(ds.astype(jnp.float16), q.astype(jnp.float16), trans_a=True)",
           "dk accumulated from float16 ds"),
    Mutant("M15", LAUNCH, "lambda i, bi, h: (bi, 0, h // group, 0))",
           "lambda i, bi, h: (bi, 0, h % spec.num_kv_heads, 0))",
           "GQA head mapping h % Hkv instead of h // G (forward and dq kernels)"),
    Mutant("M16", ATTENTION, "  return out, _lse2(spec, temp, shift, low) * LN2\n",
           "  return out, _lse2(spec, temp, shift, low)\n",
           "lse returned in base 2 (plain call, the custom_vjp primal)"),
    Mutant("M20", ATTENTION, "  return ((out, _lse2(spec, temp, shift, low) * LN2),",
           "  return ((out, _lse2(spec, temp, shift, low)),",
           "lse returned in base 2 (under differentiation, the custom_vjp fwd)"),
    Mutant("M17", SOFTMAX_STATE, "return m_new, correction * self.l + jnp.sum(p, axis=1)",
           "return m_new, self.l + jnp.sum(p, axis=1)",
           "online-softmax row sum not rescaled"),
    Mutant("M21", TILE_MATH, "  return not has_temperature and scale > 0",
           "  return not has_temperature",
           "negative sm_scale folded into the exp2 (row max taken before the multiply)"),
    Mutant("M22", SOFTMAX_STATE,
           "correction = fast_math.exp2((self.m - m_safe) * logits.scale)",
           "correction = fast_math.exp2(self.m - m_safe)",
           "online-softmax correction missing the folded scale"),
    Mutant("M23", TILE_MATH, "tuple(c / p0 for c in spec.cap_params)",
           "spec.cap_params", "cap parameter moved into the scale but not divided out"),
    Mutant("M24", TILE_MATH, "  return 0.5 * (lo + hi)\n", "  return hi\n",
           "fixed exp2 shift at the cap's upper bound (rows at the lower one underflow)"),
    Mutant("M25", TILE_MATH, "  return 0.5 * (lo + hi)\n", "  return lo\n",
           "fixed exp2 shift at the cap's lower bound (rows at the upper one overflow)"),
    Mutant("M26", TILE_MATH, "(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))",
           "(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))",
           "fixed exp2 shift for float16 inputs (probabilities overflow its range)"),
    Mutant("M27", SEGMENT_SPANS, "hi = 1 - jnp.take_along_axis(ends[..., 1], ids, axis=1)",
           "hi = -jnp.take_along_axis(ends[..., 1], ids, axis=1)",
           "segment spans one short: the last key of each segment's extent skipped"),
    Mutant("M31", SEGMENT_SPANS, "jnp.where(ends, index + 1, t)", "jnp.where(ends, index, t)",
           "runs of one id one short (the spans of in-order ids and the unmasked tiles)"),
    Mutant("M32", TILE_MATH, "_ceil_div(uniform_lo, block), _div(uniform_hi, block), lo, hi)",
           "_ceil_div(uniform_lo, block), _ceil_div(uniform_hi, block), lo, hi)",
           "a tile partly outside its run of one id run without its segment ids (masked by "
           "position only, or unmasked)"),
    Mutant("M28", TILE_MATH, "jnp.minimum(hi, _ceil_div(span_hi, block))",
           "jnp.minimum(hi, _div(span_hi, block))",
           "tile range narrowed to a segment span rounded down at its end (a partial tile dropped)"),
    Mutant("M29", CAP_FORMS, "FAST_CAP_MAX_PARAM = 64.0", "FAST_CAP_MAX_PARAM = float('inf')",
           "bfloat16 fast tanh for any cap (its error grows with the cap)"),
    Mutant("M30", TILE_MATH, "  return jnp.dtype(dtype) == jnp.dtype(jnp.float16)",
           "  return False",
           "float16 ds cast without the power-of-two scale (overflows past 65504)"),
    Mutant("M33", TILE_MATH, "                                   jnp.int32(_MAX_SCALE_UP)))",
           "                                   jnp.int32(0)))",
           "float16 ds not scaled up into the normal range (small ds round to the subnormal "
           "spacing, one way: a bias)"),
    Mutant("M34", SOFTMAX_STATE,
           "  return jnp.dtype(value_dtype) != jnp.dtype(jnp.float32) and spec.cap_method != \"none\"",
           "  return False",
           "capped 16-bit output normalised by the unrounded sum of its probabilities (a row "
           "of a few values rounded alike for P @ V: a bias)"),
    Mutant("M35", TILE_MATH, "  return capped, capped or spec.z_loss_weight != 0.0",
           "  return False, False",
           "backward's 16-bit P and ds rounded to nearest under a cap or a z-loss (a row of "
           "equal values rounded alike: a bias)"),
    Mutant("M36", CAP_FORMS, 'register_fast_form("tanh", *tanh_cap(approx_tanh, tanh_complement))',
           'register_fast_form("tanh", *tanh_cap(approx_tanh, lambda y, t: 1.0 - t * t))',
           "bfloat16 fast tanh cap's derivative as 1 - t^2 of the fast t (0 where the logits "
           "saturate: dq and dk toward zero)"),
    Mutant("M37", TILE_MATH,
           "  ds = p * (dp - along_queries(delta, p, logits.query_axis))\n",
           "  ds = p * (dp - along_queries(delta, p, logits.query_axis))\n"
           "  ds = jnp.where(jnp.abs(logits.scores * logits.scale) > 1e4 * LOG2E, ds * 1.01, ds)\n",
           "planted: the logits' gradient 1% too large where |logit| passes 1e4 (only large "
           "logits show it)"),
    Mutant("M19", SOFTMAX_STATE, "m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)", "m_safe = m_new",
           "no guard for rows whose keys in a tile are all hidden (NaN)"),
    # --- defects small in max-abs error (docs/TOLERANCES.md, "Exact mask") ---
    Mutant("S1", TILE_MATH, "conditions.append(k_pos <= q_pos)",
           "conditions.append(k_pos.astype(jnp.bfloat16) <= q_pos.astype(jnp.bfloat16))",
           "causal positions compared in bfloat16 (exact up to 256): beyond T = 256 a query "
           "sees up to T/256 - 1 future keys, each of weight about 1/T"),
    Mutant("S2", KERNELS, "  o_ref[...] = out.astype(o_ref.dtype)\n",
           "  if jnp.dtype(o_ref.dtype) == jnp.dtype(jnp.bfloat16):\n"
           "    out = lax.bitcast_convert_type(lax.bitcast_convert_type(\n"
           "        out.astype(jnp.float32), jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)\n"
           "  o_ref[...] = out.astype(o_ref.dtype)\n",
           "bfloat16 forward outputs rounded toward zero, not to nearest: within one ulp of every "
           "element, every element biased toward zero"),
    Mutant("S3", TILE_MATH, "  return to_operand(scaled, dtype, bits), exponent",
           "  return scaled.astype(jnp.bfloat16).astype(dtype), exponent",
           "float16 ds rounded through bfloat16 (3 significand bits fewer): dq and dk errors grow "
           "several-fold, inside the bound", rotates=False),
    Mutant("S4", TILE_MATH, "    ds = ds * cap_grad(logits.cap_arg, *logits.cap_params)\n",
           "    ds = ds * (1.0 if spec.cap_method == 'hard' else\n"
           "               cap_grad(logits.cap_arg, *logits.cap_params))\n",
           "hard cap's gradient passed straight through (1 beyond the cap instead of 0)"),
    Mutant("S5", LAUNCH, "  q = _pad(q, {1: layout.q_pad, 3: layout.head_dim})\n"
           "  k, v = (_pad(x, {1: layout.kv_pad, 3: layout.head_dim}) for x in (k, v))",
           "  q = _pad(q[..., :128], {1: layout.q_pad, 3: layout.head_dim})\n"
           "  k, v = (_pad(x[..., :128], {1: layout.kv_pad, 3: layout.head_dim}) for x in (k, v))",
           "head-dim columns beyond 128 dropped from q, k and v (a kernel written for D <= 128): "
           "wrong only for D > 128"),
    # --- production scale (the scale profile; docs/MUTATION.md, "Production scale") -----------
    # Of the three classes, the int32 element offset that wraps has no place in these kernels
    # (they address tiles, not elements): tests/outside_kernels.py plants it in a wrapper.
    Mutant("P1", TILE_MATH,
           "  q_pos, k_pos = _tile_grid(q_pos, shape, query_axis), _tile_grid(k_pos, shape, "
           "key_axis)\n",
           "  q_pos, k_pos = _tile_grid(q_pos, shape, query_axis), _tile_grid(k_pos, shape, "
           "key_axis)\n"
           "  q_pos, k_pos = (p.astype(jnp.int16).astype(jnp.int32) for p in (q_pos, k_pos))\n",
           "positions held in 16 bits in the mask: exact below 32768, every causal or window "
           "mask wrong past it", rotates=False),
    # --- the fused backward's dq (ua_kernels.backends:fused_attention on Hopper; docs/MUTATION.md,
    # "A race") ------------------------------------------------------------------------------
    Mutant("R1", "ua_kernels/mosaic/dkv.py",
           "    if self.order is None:  # ordered, the last add has landed before its turn "
           "passed\n      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last share "
           "has left out_smem\n", "",
           "the fused backward's dq share written over the last one before its TMA add has "
           "read it: a key tile's share lost or mixed only where the copy engine lags the "
           "compute (a race)", rotates=False),
    Mutant("R2", "ua_kernels/mosaic/dkv.py",
           "      plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # added, not only read\n",
           "",
           "the ordered fused backward's turn passed on before its add has landed: the next "
           "rank's add may land first, so a dq tile's sum changes order (and bits) from run "
           "to run only where the copy engine lags (a race)", rotates=False),
    Mutant("P2", CAP_FORMS, '"tanh": tanh_cap(jnp.tanh)',
           '"tanh": tanh_cap(lambda x: (jnp.exp(2 * x) - 1) / (jnp.exp(2 * x) + 1))',
           "the exact tanh cap as a ratio of exponentials: inf / inf = NaN once |x / cap| "
           "passes 44 (float32 exp overflows at 88.7)"),
]

# The black-box suite (what runs against any --impl): saved regressions first,
# then the properties. White-box kernel unit tests are left out on purpose.
TEST_ORDER = ["tests/test_regressions.py", "tests/test_properties.py"]


def _case(name: str) -> str:
  return f"tests/test_regressions.py::test_regression_case[{name}]"


def _prop(test_id: str) -> str:
  return f"tests/test_properties.py::test_property[{test_id}]"


# The test that kills each mutant first (docs/MUTATION.md), run before the rest of the
# black-box suite: a mutant killed by the corpus's last case, or by a property after the
# corpus, otherwise waits minutes for it. A hint that no longer kills its mutant costs one
# test's time, not a verdict: the whole suite follows it.
FIRST_TESTS = {
    "O1": _case("original-O1-mask-before-cap"),
    "O2": _case("original-O2-causal-loop-bound"),
    "O3": _case("original-O3-window-lower-bound"),
    "O4": _case("original-O1-mask-before-cap"),
    "O5": _case("original-O1-mask-before-cap"),
    "O6": _case("original-O1-mask-before-cap"),
    "O7": _case("original-O3-window-lower-bound"),
    "O8": _case("precision-fixed-shift-rows-at-lower-bound"),
    "G2": _case("original-O2-causal-loop-bound"),
    "O9": _case("original-O1-mask-before-cap"),
    "M1": _case("original-O2-causal-loop-bound"),
    "M2": _case("original-O3-window-lower-bound"),
    "M3": _case("original-O1-mask-before-cap"),
    "M4": _case("original-O3-window-lower-bound"),
    "M5": _case("original-O2-causal-loop-bound"),
    "M6": _case("original-O2-causal-loop-bound"),
    "M7": _case("original-O2-causal-loop-bound"),
    "M8": _case("original-O2-causal-loop-bound"),
    "M9": _case("original-O1-mask-before-cap"),
    "M10": _case("original-O1-mask-before-cap"),
    "M11": _case("original-O2-causal-loop-bound"),
    "M12": _case("original-O1-mask-before-cap"),
    "M13": _case("mutant-S4-hard-cap-gradient-straight-through"),
    "M14": _case("original-O1-mask-before-cap"),
    "M15": _case("mutant-S2-bfloat16-out-toward-zero"),
    "M16": _case("original-O2-causal-loop-bound"),
    "M20": _case("original-O2-causal-loop-bound"),
    "M17": _case("original-O2-causal-loop-bound"),
    "M21": _case("precision-negative-sm-scale-wide-logits"),
    "M22": _case("original-O4-per-block-renormalised-p"),
    "M23": _case("original-O2-causal-loop-bound"),
    "M24": _case("precision-fixed-shift-rows-at-lower-bound"),
    "M25": _case("precision-fixed-shift-rows-at-upper-bound"),
    "M26": _case("precision-fixed-shift-float16-overflow"),
    "M27": _prop("matches_oracle-float16"),
    "M31": _case("precision-float32-lse-cancelling-logits"),
    "M32": _case("original-B33-float16-ds-below-normal-dk-bias"),
    "M28": _case("original-O1-mask-before-cap"),
    "M29": _case("precision-bfloat16-fast-tanh-huge-cap"),
    "M37": _case("mutant-M37-bfloat16-offset-logits-dq-dk-bias"),
    "M30": _case("precision-float16-ds-overflow-zloss-temperature"),
    "M33": _case("original-B33-float16-ds-below-normal-dk-bias"),
    "M34": _case("original-B33-bfloat16-hard-cap-large-out-bias"),
    "M35": _case("original-B33-bfloat16-hard-cap-saturating-dv-bias"),
    "M36": _case("original-B34-bfloat16-fast-tanh-derivative-saturated-dq-bias"),
    "M19": _case("original-O2-causal-loop-bound"),
    "S1": _case("mutant-S1-causal-positions-in-bfloat16"),
    "S2": _case("mutant-S2-bfloat16-out-toward-zero"),
    "S4": _case("mutant-S4-hard-cap-gradient-straight-through"),
    "S5": _case("mutant-S5-head-dim-beyond-128-dropped"),
}


def apply(mutant: Mutant, root: Path) -> None:
  path = root / mutant.file
  text = path.read_text()
  starts = [m.start() for m in re.finditer(re.escape(mutant.old), text)]
  if mutant.occurrence is None and len(starts) != 1:
    raise ValueError(f"{mutant.id}: expected one match in {mutant.file}, found {len(starts)}")
  at = starts[mutant.occurrence or 0]
  path.write_text(text[:at] + mutant.new + text[at + len(mutant.old):])


def source_root(path: str | Path | None = None) -> Path:
  """The source checkout to mutate (default: the current directory)."""
  root = Path(path or Path.cwd()).resolve()
  if not (root / KERNELS).is_file() or not (root / "tests").is_dir():
    raise SystemExit(f"benchmarks.mutation needs a source checkout of unified-attention; {root} has no "
                     f"{KERNELS} or tests/ (use --repo)")
  return root


def _copy_repo(root: Path, dest: Path) -> None:
  """The checkout without what the suite does not read, but with the precision
  baselines (docs/baselines), whose verdict kills a mutant that only makes the
  errors grow (S3): without them that verdict never ran in a mutant's copy."""
  # .ci-*: CI's compile cache (used in place, its path absolute), wheel and logs.
  ignore = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", "ua-failures", "*.egg-info",
                                  ".venv*", "benchmarks", "docs", "ua-report*", ".whl", ".ci-*")
  shutil.copytree(root, dest, ignore=ignore, dirs_exist_ok=True)
  if (root / "docs" / "baselines").is_dir():
    shutil.copytree(root / "docs" / "baselines", dest / "docs" / "baselines", dirs_exist_ok=True)


def _run_pytest(copy: Path, targets: list[str], timeout: float) -> tuple[str, int | None]:
  """pytest on ``targets`` in the mutant's copy, stopping at the first failure:
  (its output, its exit code; None when it ran past ``timeout``)."""
  # The copy comes first on the path, so the plugin (entry point) and the
  # kernels it judges are both the mutated copy's.
  env = dict(os.environ, PYTHONPATH=str(copy))
  cmd = [sys.executable, "-m", "pytest", *targets, "-x", "-q", "-p", "no:cacheprovider",
         "--hypothesis-profile=ua-ci", f"--ua-failures={copy / 'ua-failures'}",
         "-o", "addopts="] + _baseline_args(copy)
  try:
    proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                          timeout=max(timeout, 1.0))
    return proc.stdout + proc.stderr, proc.returncode
  except subprocess.TimeoutExpired as exc:
    out = exc.stdout or ""
    return (out.decode() if isinstance(out, bytes) else out), None


def _failures(output: str) -> list[str]:
  failed = re.findall(r"^FAILED (\S+)", output, re.M)
  # A campaign verdict (properties/judge/gates.py) fails the session with no test failed.
  failed += [f"::{kind}-verdict[{group}]" for kind, group in
             re.findall(r"^(bias|baseline) (\S+)\s+(?:BIASED|REGRESSED)", output, re.M)]
  return failed


def run_mutant(mutant: Mutant, root: Path, timeout: float, save_cases: Path | None = None) -> dict:
  """Applies the mutant to a copy of the checkout and runs its first test
  (FIRST_TESTS) alone, then, unless that killed it, the whole black-box suite
  (pytest runs a test named beside its file in the file's order, so the first
  test needs its own run)."""
  with tempfile.TemporaryDirectory(prefix=f"ua-mutant-{mutant.id}-") as tmp:
    copy = Path(tmp)
    _copy_repo(root, copy)
    apply(mutant, copy)
    start = time.time()
    output, code, failed = "", 0, []
    if mutant.id in FIRST_TESTS:
      output, code = _run_pytest(copy, [FIRST_TESTS[mutant.id]], timeout)
      failed = _failures(output)
    if code is not None and not failed:
      output, code = _run_pytest(copy, TEST_ORDER, timeout - (time.time() - start))
      failed = _failures(output)
    seconds = time.time() - start
    saved = sorted((copy / "ua-failures").glob("*.json"))
    if save_cases and saved:
      save_cases.mkdir(parents=True, exist_ok=True)
      shutil.copy(saved[0], save_cases / f"mutant-{mutant.id}-{saved[0].name}")
  if code is None:
    status = "timeout"
  elif code == 0:
    status = "survived"
  elif failed:
    status = "killed"
  else:
    status = "error"
  killer = failed[0].split("::", 1)[-1].split(" ")[0] if failed else ""
  return {"id": mutant.id, "status": status, "killed_by": killer, "seconds": round(seconds, 1),
          "description": mutant.description, "tail": output[-1500:] if status == "error" else ""}


def _baseline_args(copy: Path) -> list[str]:
  """--ua-baseline with the checkout's precision baseline of ua_kernels for
  the running jax release (docs/baselines/), where there is one: a mutant that
  only makes the errors grow is killed by that verdict."""
  import jax
  path = copy / "docs" / "baselines" / f"ua_kernels-ci-jax{jax.__version__}.json"
  return [f"--ua-baseline={path}"] if path.exists() else []


def rotating_subset(count: int, key: str | None = None) -> list[Mutant]:
  """``count`` mutants chosen by a key (default: today's date), so successive
  CI runs cover the whole list; seed-defect mutants rotate in like the rest."""
  key = key or datetime.date.today().isoformat()
  rotating = [m for m in MUTANTS if m.rotates]
  offset = int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(rotating)
  return [rotating[(offset + i) % len(rotating)] for i in range(min(count, len(rotating)))]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.mutation", description=__doc__)
  parser.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
  parser.add_argument("--rotate", type=int, default=0,
                      help="run only this many mutants, chosen by --key (CI)")
  parser.add_argument("--key", default=None, help="rotation key (default: today's date)")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
  parser.add_argument("--list", action="store_true")
  parser.add_argument("--save-cases", type=Path, default=None,
                      help="copy each mutant's first failing case file here")
  parser.add_argument("--repo", default=None, help="source checkout (default: the current directory)")
  args = parser.parse_args(argv)
  root = source_root(args.repo)
  mutants = MUTANTS
  if args.only:
    mutants = [m for m in MUTANTS if m.id in set(args.only)]
  elif args.rotate:
    mutants = rotating_subset(args.rotate, args.key)
  for m in mutants:  # every mutant must still apply to the current source
    check_applies(m, root)
  if args.list:
    for m in mutants:
      print(f"{m.id:4} {m.file:28} {m.description}")
    return 0
  print(f"{'mutant':6} {'status':9} {'seconds':>8}  killed by / description", flush=True)
  results = []
  for m in mutants:
    r = run_mutant(m, root, args.timeout, args.save_cases)
    results.append(r)
    print(f"{r['id']:6} {r['status']:9} {r['seconds']:8.1f}  {r['killed_by'] or '-'}  "
          f"({r['description']})", flush=True)
    if r["tail"]:
      print(r["tail"])
  killed = sum(r["status"] == "killed" for r in results)
  print(f"\n{killed}/{len(results)} mutants killed")
  return 0 if killed == len(results) else 1


def check_applies(mutant: Mutant, root: Path | None = None) -> None:
  """Applies the mutant to a throwaway copy of its file; raises if its text does
  not match exactly once (or the given occurrence) or the change is a no-op."""
  with tempfile.TemporaryDirectory(prefix="ua-mutant-check-") as tmp:
    target = Path(tmp) / mutant.file
    target.parent.mkdir(parents=True)
    shutil.copy(source_root(root) / mutant.file, target)
    before = target.read_text()
    apply(mutant, Path(tmp))
    if target.read_text() == before:
      raise ValueError(f"{mutant.id}: the change leaves {mutant.file} as it was")


if __name__ == "__main__":
  sys.exit(main())
