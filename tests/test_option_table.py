"""The suite's options are declared once (properties/campaign/option_table.py):
the plugin's --ua-NAME and ua-verify's --NAME come from the same entry, with
the same help, and ua-verify forwards every one it takes to the plugin. A
second declaration of one, in either front end, fails here."""

import re

import pytest

from properties import cli
from properties.campaign.option_table import OPTIONS
from properties.campaign.options import pytest_addoption
from properties.cli.verify import TIME_BOX_ORACLE_CHUNKS, _parser, _pytest_args


class _Recorder:
  """Stands in for pytest's parser: keeps every option the plugin adds."""

  def __init__(self):
    self.options = {}

  def getgroup(self, *_):
    return self

  def addoption(self, *names, **attrs):
    for name in names:
      self.options[name] = attrs


def _plugin_options() -> dict:
  recorder = _Recorder()
  pytest_addoption(recorder)
  return recorder.options


def _verify_actions() -> dict:
  return {flag: action for action in _parser()._actions for flag in action.option_strings}


def _words(text: str) -> str:
  return " ".join(text.split())


def test_the_plugin_adds_exactly_the_table_with_its_help_and_defaults():
  options = _plugin_options()
  assert set(options) == {o.plugin_flag for o in OPTIONS}
  for option in OPTIONS:
    attrs = options[option.plugin_flag]
    assert attrs["help"] == option.help_for(plugin=True)
    assert attrs["default"] == option.default
    assert "{" not in attrs["help"]  # every {--name} filled in


def test_ua_verify_takes_each_table_option_with_the_same_help():
  actions = _verify_actions()
  help_text = _words(_parser().format_help())
  for option in OPTIONS:
    if not option.in_verify:
      assert option.verify_flag not in actions
      continue
    action = actions[option.verify_flag]
    assert action.dest == option.dest
    assert action.help.startswith(option.help_for(plugin=False)), option.name
    assert _words(option.help_for(plugin=False)) in help_text
    assert "--ua-" not in action.help  # the other options named as ua-verify spells them


def test_ua_verify_declares_no_plugin_option_of_its_own():
  """An option whose plugin spelling is --ua-X is ua-verify's --X only
  through the table (not declared a second time in verify.py)."""
  plugin = {flag[len("--ua-"):] for flag in _plugin_options() if flag.startswith("--ua-")}
  table = {o.name for o in OPTIONS if o.in_verify}
  for flag in _verify_actions():
    if flag.startswith("--") and flag[2:] in plugin:
      assert flag[2:] in table, f"ua-verify declares {flag} outside the table"


def _value(option):
  return {int: "3", float: "2.5"}.get(option.type, f"value-of-{option.name}")


def test_ua_verify_forwards_every_table_option():
  argv = []
  for option in OPTIONS:
    if option.in_verify:
      argv += [option.verify_flag, _value(option)]
  args = _pytest_args(_parser().parse_args(argv))
  for option in OPTIONS:
    if option.in_verify:
      assert f"{option.plugin_flag}={option.type(_value(option))}" in args, option.name
  forwarded = [a.split("=")[0] for a in args if a.startswith("--ua-") or a.startswith("--impl")]
  assert len(forwarded) == len(set(forwarded))  # each once


@pytest.mark.parametrize("argv, expected, absent", [
    ([], {"--ua-report=ua-report.json", "--ua-failures=ua-failures",
          "--impl=ua_kernels:attention", "--ua-compile-threads=1"},
     ("--ua-compile-cache", "--ua-oracle-chunks", "--ua-import", "--ua-minutes")),
    (["--profile", "gpu"], {"--ua-compile-cache=.ua-jax-cache", "--ua-compile-threads=2"}, ()),
    (["--profile", "tpu", "--compile-cache", "c", "--compile-threads", "5"],
     {"--ua-compile-cache=c", "--ua-compile-threads=5"}, ()),
    (["--minutes", "2"], {f"--ua-oracle-chunks={TIME_BOX_ORACLE_CHUNKS}"}, ()),
    (["--minutes", "2", "--oracle-chunks", "7"], {"--ua-oracle-chunks=7"}, ()),
])
def test_ua_verify_keeps_its_own_defaults(argv, expected, absent):
  """ua-verify's defaults by profile and time box override the table's."""
  args = _pytest_args(_parser().parse_args(argv))
  assert expected <= set(args), args
  assert not [a for a in args if a.split("=")[0] in absent], args


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds must be at least 1, got 0"),
    (["--compile-threads", "0"], "--compile-threads must be at least 1, got 0"),
    (["--baseline", "/nonexistent-dir-test/b.json"], "--baseline /nonexistent-dir-test/b.json"),
])
def test_ua_verify_runs_the_table_checks_naming_its_own_option(argv, message, capsys):
  """The plugin's checks, run before pytest starts, name ua-verify's option."""
  with pytest.raises(SystemExit) as exit_info:
    cli.verify_main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err and not re.search(r"--ua-\w", err)
