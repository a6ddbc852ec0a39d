"""After the passes: partitioning, writing partitions and the manifest, the converter hand-off, reports."""
