import sys

from ooc.cli import main

sys.exit(main())
