"""Which training steps the loggers write.

Lightning writes a training step's logged values every trainer.log_every_n_steps steps, at a step the run stops at
(trainer.should_stop), and on every step under fast_dev_run (its update_train_step_metrics). A value logged on any
other step is never written, and a self.log costs ~0.3 ms on CPU (~1% of a default step each); worse, Lightning keeps
the last value it was given and writes it again at the next written step, under that step's number. So per-step values
are logged on these steps only, from hooks that run after every callback's (a stop a callback asks for counts).
"""

from __future__ import annotations


def loggers_write(trainer) -> bool:
    """Whether the loggers write the values logged at this training step (ask before the step ends)."""
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)
