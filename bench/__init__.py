"""The `duet bench` targets: one module per target, named after it.

Each target module owns its command line and exposes `main(argv: list[str]) -> int`;
`cluster/cli.py` maps target names to these modules in one table and is the only
code that imports this package. The modules that are not targets say what they
are in their names (`machine_ceilings`, `kv_across_nodes`, `loadgen_subprocess`,
`json_output`).
"""
