"""`python -m services.cli`: the same as the `kbmesh` command."""

from services.cli.commands import main

main()
