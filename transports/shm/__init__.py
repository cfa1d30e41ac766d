"""The shared-memory transport ``shm``: lock-free rings between the processes
of one Linux host (:mod:`.transport`; the ring itself in :mod:`.ring`) and the
shared arena the collectives meet in (:mod:`.arena`)."""
