"""Training on Lightning and Hydra: config validation, the run and its record, the LightningModule,
callbacks, loggers and checkpoints."""
