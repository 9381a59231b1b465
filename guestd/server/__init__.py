"""The daemon: transports, connections, dispatch. Each capability is a package of its own
(guestd.exec, guestd.files, ...) that gets a guestd.services.Services."""
