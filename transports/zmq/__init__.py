"""The ZeroMQ transports: ``tcp://`` between hosts and ``ipc://`` between the
processes of one host (:mod:`.transport`). How ranks connect and what every socket
refuses before authentication (:mod:`.rendezvous`), who may connect (:mod:`.auth`),
the I/O thread (:mod:`.progress`), the frames and their checks (:mod:`.wire`), and
the shared-memory payload slots ``ipc`` uses for mid-size messages (:mod:`.slabs`)."""
