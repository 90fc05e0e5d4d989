"""The front doors: every way a user comes in, each composing and checking its input as train.py
does (framework.config.door) before any worker or role starts.

- launch: train.py's launcher (a plain run, a sweep, a restart; the run folder's lock);
- evaluate, generate, harness: a checkpoint, run folder or pretrained model read back;
- plan: the planner's table and its dry run; export: a checkpoint to Hugging Face files;
- report: a sweep's table and plots; compose: the config a worker runs with, for tests and
  benchmarks; preload: what the workers' forkserver imports.

The command paths users type (`python -m framework.evaluate`, ...) are shims of these."""
