import sys

from kvplan.cli import main

sys.exit(main())
