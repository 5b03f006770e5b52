import sys

from qlsd_flwr.deploy.cli import main

sys.exit(main())
