"""The daemon: transports, connections (to a narrow ConnectionHost), the admission chain every
request passes (admission.py), dispatch. It names no capability: each is a package of its own
(guestd.exec, guestd.files, ...) that gets a guestd.services.Services, composed into the server
by guestd/capabilities.py."""
