import sys

from ajet.cli import main

sys.exit(main())
