import sys

from dyspec.cli import main

sys.exit(main())
