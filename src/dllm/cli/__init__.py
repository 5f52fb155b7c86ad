"""The `dllm` command line: one typer app, one module per command group."""
