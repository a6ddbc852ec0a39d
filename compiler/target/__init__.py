"""What an SDK can run: capability tables and node verdicts."""
