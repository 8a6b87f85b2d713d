"""``python -m swarmfs ...``: the ``swarmfs`` command line."""

from ._cli import main

main(prog_name="swarmfs")
