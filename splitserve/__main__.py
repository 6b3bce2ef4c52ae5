"""``python -m splitserve`` is the ``splitserve`` command."""
from splitserve.cli import main

main()
