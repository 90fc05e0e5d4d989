"""Checkpoints: the step folders, saving and loading (store.py), DCP's verified writer and safe
reader (io.py), the manifest and its verification (integrity.py), which checkpoint a run
continues from (resume.py), and one writer per run folder (runlock.py). Nothing is re-exported
here: import the module you need (`from framework.checkpoint import store`)."""
