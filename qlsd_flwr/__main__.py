import sys

from qlsd_flwr.cli import main

sys.exit(main())
