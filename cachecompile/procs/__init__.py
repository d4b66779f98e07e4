"""Between processes: ``coop`` (the compile lock and one compile of a graph shared by
ranks), ``node`` (once-per-node steps), ``poll`` (waiting on the file system)."""
