"""The benchmarks' one harness: the catalog of benchmarks (``python -m benchmarks NAME``), the
results schema and its one writer, the converter of the results written before the schema, and
the renderer of docs/benchmarks/ from the results.

Nothing here imports numpy, torch or matplotlib at module level: the renderer's test reads every
committed result and renders every page in well under a second, and the GPU machine's bare
interpreter imports the writer.
"""
