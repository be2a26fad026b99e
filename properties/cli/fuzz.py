"""ua-fuzz: a randomized campaign on one cap method (docs/ADDING_A_CAP_METHOD.md)."""

from __future__ import annotations

import argparse
import time

from ..run.loading import DEFAULT_IMPL, import_modules
from .verify import PROFILE_NAMES


def _derivative_hint(case, failed_outputs) -> str:
  """What a capped case failing in dq/dk alone points to."""
  grads = {"dq", "dk"}
  if case.cap_method != "none" and set(failed_outputs) and set(failed_outputs) <= grads:
    return (f"\nhint: dq/dk fail while out/dv pass on a {case.cap_method!r}-capped case: "
            f"the cap's hand-written derivative is the likely cause")
  return ""


def _checked_impl(parser, args):
  """The implementation under --impl, once the cap method under --cap is
  consistent with its own declarations and the implementation's forms; None
  (after printing why) where it is not."""
  from ua_reference.caps import get_cap_method
  from ..checks.cap_checks import precheck
  from ..model.capabilities import load_impl

  try:
    method = get_cap_method(args.cap)
  except ValueError as exc:
    parser.error(f"--cap: {exc}")
  try:
    impl = load_impl(args.impl)
  except Exception as exc:  # noqa: BLE001 -- a usage error
    parser.error(f"--impl {args.impl}: cannot load the implementation "
                 f"({type(exc).__name__}: {exc})")
  if args.cap != "none" and "cap" in impl.unsupported:
    parser.error(f"{args.impl} declares cap methods unsupported")
  if not impl.supports_cap(method.name):
    parser.error(f"{args.impl} declares cap method {method.name!r} unsupported "
                 f"(ua_cap_methods)")
  forms = impl.cap_forms(method.name) if impl.cap_forms else None
  print(f"checking cap method {method.name!r} (derivative, bounds, homogeneity, "
        f"{'the implementation form' if forms else 'no implementation form'})...", flush=True)
  problem = precheck(method.name, forms)
  if problem:
    print(f"FAIL: {problem}")
    return None
  print("cap method consistent with its declarations", flush=True)
  return impl


def fuzz_main(argv=None) -> int:
  """ua-fuzz --cap NAME --minutes M: a randomized campaign on one cap method.

  First checks the method itself (derivative against autodiff, declared
  bounds and homogeneity, the implementation's own forms); then draws
  attention cases with that cap until the time is up or a failure is found,
  which is reported once, with its replay command.
  """
  parser = argparse.ArgumentParser(prog="ua-fuzz", description=fuzz_main.__doc__)
  parser.add_argument("--cap", required=True)
  parser.add_argument("--minutes", type=float, default=5.0)
  parser.add_argument("--impl", default=DEFAULT_IMPL)
  parser.add_argument("--out", default="ua-failures", help="where failing cases go")
  parser.add_argument("--profile", default="dev", choices=PROFILE_NAMES,
                      help="whose shape buckets to draw from")
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  args = parser.parse_args(argv)
  if not args.minutes > 0:
    parser.error(f"--minutes must be positive, got {args.minutes:g}")
  try:
    imports = import_modules(args.imports)
  except Exception as exc:  # noqa: BLE001 -- a usage error
    parser.error(f"--import {args.imports}: {type(exc).__name__}: {exc}")
  from hypothesis import HealthCheck, Phase, given, settings
  from hypothesis import strategies as st
  from hypothesis.database import DirectoryBasedExampleDatabase

  from ..checks.registry import PROPERTIES
  from ..model.profiles import PROFILES
  from ..model.strategies import cases
  from ..run.verifier import CaseFailure, Verifier

  impl = _checked_impl(parser, args)
  if impl is None:
    return 1

  # Properties that a case capped with this method can exercise: those the
  # implementation can run, needing no feature but the cap and not replacing
  # the cap with another method.
  usable = [p for p in PROPERTIES if p.unsupported_by(impl) is None
            and not set(p.require) - {"cap"} and "cap" not in p.forbid
            and p.uses_cap_method is None]
  buckets = PROFILES[args.profile].buckets
  verifier = Verifier(impl, args.out, imports)
  deadline = time.time() + 60 * args.minutes
  ran = 0

  @st.composite
  def drawn(draw):
    prop = draw(st.sampled_from([p for p in usable if p.oracle] * 4 + usable))
    case = draw(cases(buckets, impl, prop.require, prop.forbid, prop.any_of,
                      cap=args.cap).filter(prop.draws))
    return prop, case

  # Rounds of fresh random examples until the time is up; a failure saved by
  # an earlier campaign replays first (and is reported, once, like a new one).
  @settings(max_examples=25, deadline=None, derandomize=False,
            database=DirectoryBasedExampleDatabase(f".hypothesis/ua-fuzz-{args.cap}"),
            phases=[Phase.reuse, Phase.generate, Phase.target],
            suppress_health_check=list(HealthCheck))
  @given(drawn())
  def campaign(item):
    nonlocal ran
    if time.time() < deadline:
      ran += 1
      verifier.check(*item)

  try:
    while time.time() < deadline:
      campaign()
  except CaseFailure as exc:
    print(f"\nFAIL after {ran} case(s):\n{exc}{_derivative_hint(exc.case, exc.failed_outputs)}")
    print(f"\nua-fuzz --cap {args.cap}: stopped at the first failure")
    return 1
  print(f"\nua-fuzz --cap {args.cap}: {ran} cases in {args.minutes:g} min, no failure")
  return 0
