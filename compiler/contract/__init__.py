"""The graph I/O contract of compiled LLM graphs (DESIGN "Contracts"), end to end.

One owner for what the passes, compile's manifest, verify and the reference runtime agree on:

    io         names, roles and dtypes of the compiled graph inputs/outputs, and their order
    exporters  how each exporter spells its cache tensors, mapped onto the contract's
    mask       the additive attention mask: default value, the one causal builder
    positions  position rules (real tokens count from the first free cache slot; padding repeats)
    cache      static cache layouts (`new` / `sliding`) and how a runtime keeps them

Imports nothing of mtkc above `mtkc.errors` (the passes, pipeline and runtime import it).
"""
