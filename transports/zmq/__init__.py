"""The ZeroMQ transports: ``tcp://`` between hosts and ``ipc://`` between the
processes of one host (:mod:`.transport`), who may connect (:mod:`.auth`), and
the shared-memory payload slots ``ipc`` uses for mid-size messages (:mod:`.slabs`)."""
