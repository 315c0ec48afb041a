"""Running a stage: the spec turned into a job config, the stage policy after each job, incidents read from a job's
records, the operator's stop, time budgets and how a run ended."""
