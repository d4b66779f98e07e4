"""The cold path: a miss. ``capture`` traces with Dynamo and the adapter and captures what
an entry holds; ``guard_capture`` turns Dynamo's guards into portable ones; ``miss`` runs
a miss in order (lock, look again, trace, verify, publish). The only package that imports
Dynamo and Inductor (through ``_torch``)."""
