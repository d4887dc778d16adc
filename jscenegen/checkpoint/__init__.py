"""Checkpoints: the orbax store, metadata, checksums and resume (imported by module)."""

RUN_CHECKPOINTS = "checkpoints"
"""A training run's checkpoint directory, `RUN_DIR/checkpoints/<step>/` (the store's root)."""

RUN_RECORD = "run.json"
"""`RUN_DIR/run.json`, written by each start of `jscenegen train` (`pipeline.write_run_files`):
{"model_dir": the model the run started from, "config_source": the config it was given}."""

RUN_REPORTS = ("eval_before", "eval_after", "eval_change")
"""The evaluation reports `jscenegen train` writes into RUN_DIR (`<stem>.json`, and its plot
`<stem>.png`) with `trainer.eval_before_after`; `trainer.eval_every` writes `eval_update_<N>`."""

RUN_ASSETS = "hf_assets"
"""`RUN_DIR/hf_assets/`: a resumed run's config and tokenizer when it has no model directory of
its own (a run made by `convert --to orbax`): copied once from the newest step's `hf/`, which
the store deletes when newer steps replace it (`checkpoint.resume.resume_model_dir`)."""
