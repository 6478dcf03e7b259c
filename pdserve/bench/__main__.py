"""``python -m pdserve.bench {bench,goodput,compare} ...``"""

import sys

from pdserve.bench.cli import main

sys.exit(main())
