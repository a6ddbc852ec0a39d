"""Capability tables, one TOML file per NeuroPilot SDK version (`neuropilot-<ver>.toml`).

Data only: the loader and the constraint vocabulary live in `mtkc.target.capability`.
"""
