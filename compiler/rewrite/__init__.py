"""What a pass is: the Pass API, the registry, the pattern language passes match and emit with."""
