"""The graph and its file: lazy load and validation, weights, graph helpers, shape inference, running a graph in onnxruntime."""
