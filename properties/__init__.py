"""The verification suite: strategies, tolerance model, runner and CLIs."""
