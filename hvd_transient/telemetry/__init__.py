"""What a run records: the typed events (``schema``) and the event log in the run's store (``events``)."""
