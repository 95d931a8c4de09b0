"""`python -m megatron_dhp` is the `megatron-dhp` command."""

import sys

from megatron_dhp.cli import main

sys.exit(main())
