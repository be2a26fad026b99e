"""Running a property on a case the way a campaign does: the verifier (case
files, timeouts, replay commands), the compile clock, the default --impl and
the loading of --import modules. Imports the model, the judge and the checks."""
