import sys

from qlsd_flwr.run.cli import main

sys.exit(main())
