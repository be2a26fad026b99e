"""Running a property on a case the way a campaign does: the verifier (case
files, timeouts, replay commands), the compile clock, and the loading of
--impl and --import. Imports the model, the judge and the checks."""
