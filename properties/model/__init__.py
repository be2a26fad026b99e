"""What a case is: its configuration, its inputs, the strategies that draw it,
the profiles' buckets, and an implementation's declarations. The lowest
layer: it imports nothing else of the suite (tests/test_import_hygiene.py)."""
