"""`python -m evalsuite.cli`: the command line, as the `evalsuite` script runs it."""

from evalsuite.cli.app import main

main()
