"""``python -m trainer.zygote --socket PATH --owner PID --preload a,b``: the zygote's server."""

import sys

from trainer.zygote.server import main

sys.exit(main())
