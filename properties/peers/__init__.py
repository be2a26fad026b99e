"""Adapters of other attention implementations to the suite's calling
convention, with their declarations, for ua-verify --impl (docs/PEERS.md).
Imports the model only."""
