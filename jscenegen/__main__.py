"""`python -m jscenegen`: the same command as the `jscenegen` console script."""
import sys

from jscenegen.cli import main

sys.exit(main())
