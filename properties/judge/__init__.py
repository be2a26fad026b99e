"""How an implementation's outputs are judged: the reference run beside it
(runner), the tolerances and their error terms, and the statistical verdicts
of bias and of a precision baseline (docs/TOLERANCES.md). Imports the model
only."""
