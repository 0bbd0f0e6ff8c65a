"""`python -m kareus_node` runs the node daemon (same as `kareus-node`)."""

import sys

from kareus_node.main import main

sys.exit(main())
