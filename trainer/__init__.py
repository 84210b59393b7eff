"""The trainer's own parts, below train.py: the flags and their validation (trainer/config.py), --config files, faults
(preemption, the watchdog, test hooks) and what a run saves and resumes (resume.py)."""
