"""Experiment tracking: what the learner's rank 0 records for a run, behind
one small interface (:class:`~learner.tracking.base.Tracker`), with one file
per backend (``wandb``, ``tensorboard``).

Rank 0 logs, whatever launched the run (``up``, Kubernetes, Slurm): every
step's scalars (the PPO statistics, reward, success, compactions, staleness,
summary length, all from the batch it trained on: actors and the replay
report through the rollouts that already flow), a table of sampled rollouts
every ``tracking.samples_every`` steps (task, the summaries written, the
final answer, reward, compactions, staleness), and once the run's settings
and git revision.
"""

