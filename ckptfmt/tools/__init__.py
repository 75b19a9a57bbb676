"""Tools over checkpoints and runs: validation, inspection, diff, conversions, export / import,
plot. Library functions that return data (the CLI formats it); torch is needed only by the
``.pt`` and DCP converters, which import it lazily; matplotlib only inside ``plot``.
"""
