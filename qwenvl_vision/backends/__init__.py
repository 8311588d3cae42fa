"""How a tower's forward runs on a machine, behind one seam: the tower asks a backend for the call's execution and
never reads its state. ``cpu``: the CPU inference backend on the machine's measured plan."""
