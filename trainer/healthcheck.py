"""``python -m trainer.healthcheck``: the node check's entry under its name of the release before
(now ``trainer.nodecheck``), for an orchestrator of that release; removed in the next one."""

from trainer.common.process import exit_now
from trainer.nodecheck import main

if __name__ == "__main__":
    exit_now(main())
