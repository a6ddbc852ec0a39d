"""The pass manager: pipelines, plugins, invariants after every pass, verify-each."""
