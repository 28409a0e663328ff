"""python -m fusion_bridge [info|explain|parity|tune|bench|matrix] ... (see
fusion_bridge/cli/main.py)."""

import sys

from fusion_bridge.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
