"""Drop-in runtimes for agent frameworks (optional extras: ``pip install guestd[swerex]``,
``guestd[minisweagent]``). The daemon never imports this package."""
