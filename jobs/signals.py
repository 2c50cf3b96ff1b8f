"""What other modules may react to in a job's life, without the job model importing them."""

from __future__ import annotations

from django.dispatch import Signal

# Sent once per move of a job into a terminal status, by the process whose UPDATE won (Job._ended),
# with `job`. Receivers: the job's callback (jobs/callbacks.py) and the scheduler, whose freed
# places go to other jobs (jobs/scheduler.py); connected in JobsConfig.ready().
job_ended = Signal()
# Sent once a batch's output files are written and it is final (jobs/batches.finalize), with `job`: its
# callback (`batch.<status>`) is announced then, not when its job ends.
batch_finalized = Signal()
