"""loadgen: load tests and capacity planning against any OpenAI-compatible server.

A client only: it imports nothing of the server's rooms. Entry points:
`loadgen.cli.bench_serve_main` (`duet bench serve`) and `loadgen.cli.plan_main`
(`duet plan`), or `python -m loadgen {bench-serve,plan}`.
"""
