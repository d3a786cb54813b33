import sys

from pslink.core.aggregator.process import main

sys.exit(main())
