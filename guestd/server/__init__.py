"""The daemon: transports, connections, dispatch. Capabilities live in guestd.ops."""
