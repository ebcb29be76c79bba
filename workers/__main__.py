import sys

from hsx.errors import HsxError
from workers.launcher import main

try:
    sys.exit(main())
except HsxError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
