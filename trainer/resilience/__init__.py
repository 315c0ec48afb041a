"""Fault detection and rehearsal, shared by workers, the node agent and the saver.

- ``heartbeat``: worker heartbeats (with their recent step durations) and the agent's hang
  detector, whose step timeout adapts to them.
- ``anomaly``: loss anomalies (non-finite, spikes) and the windows skipped after a rollback.
- ``rollback``: an anomaly rolled back inside the running workers (no restart).
- ``healthcheck``: node health measurements (matmul, allreduce) and their judgement.
- ``nodecheck``: the workers' node check after an in-job restart.
- ``diskfull``: recognise disk-full errors and describe them.
- ``chaos``: drills that inject faults on purpose.
"""
