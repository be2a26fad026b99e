"""ua-repro: replays one saved case file here, or minimizes it
(docs/VERIFICATION.md)."""

from __future__ import annotations

import argparse

from ..run.loading import DEFAULT_IMPL, import_modules


def repro_main(argv=None) -> int:
  """ua-repro CASE.json [--impl module:function] [--minimize]: replays one saved
  case here; with --minimize, reduces it while it fails the same way and writes
  CASE.min.json beside it (properties/campaign/minimize.py)."""
  parser = argparse.ArgumentParser(prog="ua-repro", description=repro_main.__doc__)
  parser.add_argument("case_file")
  parser.add_argument("--impl", default=None,
                      help="implementation (default: the one recorded in the file)")
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  parser.add_argument("--minimize", action="store_true",
                      help="reduce the case while the same property fails on the same "
                           "outputs; write <name>.min.json beside it")
  parser.add_argument("--max-attempts", type=int, default=200,
                      help="with --minimize: candidate cases to run at most")
  parser.add_argument("--max-seconds", type=float, default=600.0,
                      help="with --minimize: no new candidate after this many seconds")
  args = parser.parse_args(argv)
  if args.max_attempts < 1 or not args.max_seconds > 0:
    parser.error("--max-attempts and --max-seconds must be positive")
  from ..model.case import load_case_file, versions
  try:
    payload = load_case_file(args.case_file)
  except (OSError, ValueError, KeyError, TypeError) as exc:
    parser.error(f"{args.case_file}: not a readable case file ({type(exc).__name__}: {exc})")
  names = ",".join([args.imports] + list(payload.get("imports", ())))
  try:
    imports = tuple(dict.fromkeys(import_modules(names)))
  except Exception as exc:  # noqa: BLE001 -- a usage error, not a reproduction
    parser.error(f"--import {names}: {type(exc).__name__}: {exc}")
  invalid = payload["case"].invalid()
  if invalid:
    parser.error(f"{args.case_file}: not a case the suite draws: {invalid}")
  from ..model.capabilities import load_impl
  from ..checks.checks import PropertyFailure
  from ..checks.registry import get
  from ..judge.tolerance import error_table

  impl_name = args.impl or payload.get("impl") or DEFAULT_IMPL
  try:
    impl = load_impl(impl_name)
  except Exception as exc:  # noqa: BLE001 -- nothing ran: not a reproduction
    parser.error(f"--impl {impl_name}: cannot load the implementation "
                 f"({type(exc).__name__}: {exc})")
  try:
    prop = get(payload.get("property", "matches_oracle"))
  except ValueError as exc:
    parser.error(f"{args.case_file}: {exc}")
  declared = prop.unsupported_by(impl)
  if declared is not None:
    parser.error(f"{args.case_file}: {prop.name} does not run on {impl_name}: {declared}")
  case = payload["case"]
  recorded, now = payload.get("versions", {}), versions()
  where = now.get("device", now["backend"])
  print(f"case: {case}\nproperty: {prop.name}\nimpl: {impl_name}\n"
        f"recorded: status {payload.get('status', 'failed')} on {recorded.get('device', recorded.get('backend'))}"
        f" {recorded}\nnow: {now}")
  if payload.get("status") in ("crashed", "timeout", "running"):
    print(f"note: this case {payload['status']} its worker when recorded; it may do so here")
  if args.minimize:
    from ..campaign.minimize import minimize_file
    return minimize_file(args.case_file, payload, impl, prop, imports=imports,
                         max_attempts=args.max_attempts, max_seconds=args.max_seconds)
  try:
    errors = prop.check(impl, case)
  except PropertyFailure as exc:
    print(f"FAIL: reproduces on {where}\n{exc}")
    return 1
  except Exception as exc:  # noqa: BLE001 -- the implementation (or the harness) raised
    print(f"FAIL: reproduces on {where}: raised {type(exc).__name__}: {exc}")
    return 1
  print(error_table(errors) if errors else "(no comparison)")
  print(f"PASS: does not reproduce on {where}" +
        (f" (recorded on {recorded.get('device', recorded.get('backend'))})"
         if recorded.get("backend") != now["backend"] else ""))
  return 0
