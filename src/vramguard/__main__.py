import sys

from vramguard.cli import main

sys.exit(main())
