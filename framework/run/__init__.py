"""One rank's run: the build (build.py), the loop (trainer.py), one optimizer step (step.py), the
step's figures settled (ledger.py), the measuring parts as one object (measurements.py), the run's figures (summary.py), the run folder's files
(run_files.py), preemption and faults (resilience.py), and several configs in one worker group
(sweep.py). Nothing is re-exported here: import the module you need."""
