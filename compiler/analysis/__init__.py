"""Analyses of a graph, computed by structure and cached by the pass manager (`ctx.analysis`):

    decoder   the DecoderMap: per-layer blocks anchored on attention, the global I/O roles
    cache     the KV cache of the map's layers: which input is layer i's key/value, their head dims
"""
