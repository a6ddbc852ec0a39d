"""Running compiled output: the prefill/decode generator and its host tables."""
