import sys

from mtkc.cli import main

sys.exit(main())
