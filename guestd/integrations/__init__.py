"""Drop-in runtimes for agent frameworks (optional extras: ``pip install guestd[swerex]``,
``guestd[minisweagent]``, ``guestd[openhands]``): ``swerex`` (SWE-ReX runtime and
deployment), ``minisweagent`` (mini-swe-agent environment), ``openhands`` (OpenHands SDK
workspace). The daemon never imports this package."""
