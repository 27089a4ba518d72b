"""`python -m flux_runtime.serve`: the same as the `flux-serve` command."""

from flux_runtime.serve.command import main

main()
