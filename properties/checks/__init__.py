"""The properties: what each checks, on which cases, and the registry the
plugin and the CLIs read them from (docs/VERIFICATION.md). Imports the model
and the judge."""
