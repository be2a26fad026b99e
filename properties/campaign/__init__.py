"""The suite as a pytest plugin (properties/plugin.py is its entry point): its
options, the schedule of its tests under a time box, its session hooks, the
report, example databases, the HTML page and case minimization
(docs/PLUGINS.md). Nothing here imports jax, numpy or Hypothesis at import
time: the plugin loads into every pytest session of the environment."""
